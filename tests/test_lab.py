"""labkit.lab, measure, tables on small CPU shapes: cases, picks, the paths side by side, sweeps, records, the step model."""
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from labkit import backends, measure, results, stepmodel, tables
from labkit.config import LabParams
from labkit.lab import Lab, describe, memory_table, pick, records_of, save

# bf16 output (8 mantissa bits) against the float64 oracle on the dequantized pool; see test_paths.py
TOL_DEQUANT = 4e-3


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    threads = torch.get_num_threads()
    p = LabParams.make(pool_tokens=2048, page_size=32, batch_size=3, context_lens=[40, 97, 32], num_layers=2,
                       tp_size=2)
    yield Lab.build(p, tmp_path_factory.mktemp("run"), warmup_ms=1, rep_ms=2)
    torch.set_num_threads(threads)  # Lab.build runs torch on one CPU thread


def test_lab_shape_and_cases(lab):
    assert lab.shape() == dict(pool_tokens=2048, batch_size=3, heads=8, tokens_read=169, context_len=97,
                               kv_dtype="fp8_e4m3", kv_layout="fp8_per_tensor", topk=0)
    small = lab.case(pool_tokens=512)
    assert small.pool.num_layers == 1 and small.shape()["pool_tokens"] == 512 and small.batch.num_tokens == 169
    wide = lab.case(lens=[64] * 5, heads=32)
    assert wide.q_nope.shape == (5, 32, 512) and wide.batch.num_tokens == 320 and wide.pool is lab.pool
    assert lab.bf16().pool.kv_dtype == "bf16" and "8 heads per GPU" in lab.summary()


def test_pick_by_device_and_impl(lab):
    assert pick("fp8_native", "auto", "cpu").name == "fp8_native.torch"  # torch before the interpreter
    assert pick("fp8_native", "auto", lab=lab).name == "fp8_native.torch"
    assert pick("fp8_native", "gluon", "cpu").name == "fp8_native.gluon"  # named: taken as named
    assert pick("full_pool_cast", "seed", "cpu").name == "full_pool_cast.seed"
    assert pick("bf16_pool", "seed", "cpu", lab=lab).path == "bf16_pool"  # no such impl there: select
    with pytest.raises(ValueError, match=r"impl='cutlass'; allowed: \['auto', "):
        pick("fp8_native", "cutlass", "cpu")


def test_auto_is_select_with_the_labs_call_and_precision(lab, monkeypatch):
    seen = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    pick("fp8_native", "auto", lab=lab, precision="accurate")
    pick("bf16_pool", "auto", lab=lab)
    (path, qn, pool, batch, precision), _ = seen[0]
    assert (path, precision) == ("fp8_native", "accurate") and qn is lab.q_nope and pool is lab.pool
    assert batch is lab.batch and seen[1][0][2].kv_dtype == "bf16"  # bf16_pool chooses on the BF16 copy


def test_fastest_fp8_native_is_the_minimum_over_records():
    import numpy as np

    rng = np.random.default_rng(1)
    rows = [dict(path=p, impl=i, backend=f"{p}.{i}", device_ms=float(rng.uniform(0.01, 1)))
            for p, i in [("fp8_native", "torch"), ("fp8_native", "triton_q8"), ("fp8_native", "gluon"),
                         ("fp8_native", "flashinfer"), ("bf16_pool", "triton"), ("fp8_native", "triton_rows")]]
    rows[3]["device_ms"] = 1e-6  # a peer faster than all: not ours
    rows.append(dict(path="fp8_native", impl="triton", backend="fp8_native.triton", device_ms=float("nan")))
    df = pd.concat([pd.DataFrame(rows[:3]), pd.DataFrame(rows[3:])])  # repeated index labels, as in 03
    best = tables.fastest_fp8_native(df)
    ours = df[(df.path == "fp8_native") & (df.impl != "flashinfer")].device_ms
    assert best.device_ms == ours.min() and isinstance(best.device_ms, float)
    assert best.backend == min(((r["device_ms"], r["backend"]) for r in rows if r["path"] == "fp8_native"
                                and r["impl"] != "flashinfer" and r["device_ms"] == r["device_ms"]))[1]
    with pytest.raises(ValueError, match="no fp8_native records"):
        tables.fastest_fp8_native(df[df.path == "bf16_pool"])


def test_notebook_03_reports_the_helpers_figure():
    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parent.parent / "notebooks" / "03_fp8_native_backends.ipynb", 4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "tables.fastest_fp8_native(" in code and "precision" in code


def test_gather_equals_full_cast_bit_for_bit(lab):
    out = measure.compare_outputs(lab, ["full_pool_cast.torch", "gather_cast.torch", "fp8_native.torch"])
    assert out.bitwise_equal_to_first[:2].all()
    assert (out.rel_err < TOL_DEQUANT).all()


def test_side_by_side(lab):
    from labkit.roofline import Ceilings

    c = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="test", method="given")
    df = measure.side_by_side(lab, ceilings=c).set_index("path")
    assert list(df.index) == ["full_pool_cast", "gather_cast", "fp8_native", "bf16_pool"]
    assert (df.rel_err < TOL_DEQUANT).all() and (df.median_ms > 0).all()
    assert df.bytes.full_pool_cast > df.bytes.gather_cast > df.bytes.fp8_native
    assert df.predicted_extra_bytes.full_pool_cast > df.predicted_extra_bytes.gather_cast
    assert (df.extra_bytes >= df.predicted_extra_bytes).all()  # torch keeps more than a fused kernel must
    assert df.kv_dtype.bf16_pool == "bf16" and (df.copy_gbps == 10.0).all()


def test_sweeps_name_their_points(lab):
    names = ["full_pool_cast.torch", "gather_cast.torch"]
    ps = measure.pool_sweep(lab, [256, 1024], names)
    assert list(ps.pool_tokens) == [256, 256, 1024, 1024] and set(ps.tokens_read) == {169}
    bs = measure.batch_sweep(lab, [1, 6], names)
    assert list(bs.batch_size) == [1, 1, 6, 6] and bs.read_fraction.iloc[-1] == pytest.approx(2 * 169 / 2048)
    hs = measure.heads_sweep(lab, [4, 64], 2, 100, ["fp8_native.torch"])
    assert list(hs.heads) == [4, 64] and set(hs.pool_tokens) == {2 * 4 * 32}
    cs = measure.context_sweep(lab, [33, 65], 2, ["fp8_native.torch"])
    assert list(cs.context_len) == [33, 65] and (cs.heads == 8).all()


def test_cast_share_grows_with_the_pool(lab):
    sw = measure.cast_share_sweep(lab, [256, 16384], pick("full_pool_cast", "torch", "cpu"))
    assert ((0 < sw.cast_share) & (sw.cast_share < 1)).all()
    assert sw.cast_ms.iloc[1] > sw.cast_ms.iloc[0] and sw.cast_share.iloc[1] > sw.cast_share.iloc[0]


def test_speedup_and_break_even():
    df = pd.DataFrame(dict(path=["full_pool_cast", "gather_cast"] * 3, read_fraction=[0.1, 0.1, 0.5, 0.5, 1, 1],
                           device_ms=[4.0, 1.0, 4.0, 3.0, 4.0, 5.0]))
    sp = tables.speedup(df, "read_fraction")
    assert list(sp.speedup) == [4.0, 4 / 3, 0.8]
    assert tables.break_even(sp) == 1.0
    assert tables.break_even(sp[sp.read_fraction < 1]) is None


def test_save_replaces_and_carries_the_parameters(lab):
    rows = [dict(path="fp8_native", backend="fp8_native.torch", impl="torch", median_ms=1.0, p20_ms=0.9,
                 p80_ms=1.1, pool_tokens=512, experiment="x")]
    save(rows, lab.run_dir, "t", lab.p)
    save(rows * 2, lab.run_dir, "t", lab.p)
    df = results.load_runs(lab.run_dir / "t.parquet")
    assert len(df) == 2 and (df.pool_tokens == 512).all() and (df.page_size == 32).all()
    assert (df.env_device == "cpu").all() and len(records_of(df, "x")) == 2
    assert records_of(pd.DataFrame(), "x").empty


def test_step_table_reproduces_the_seed():
    """The whole-pool cast adding the seed's 0.828 ms per layer to a BF16 kernel -> 10.5 tok/s."""
    added = stepmodel.cast_ms_per_layer()
    rec = lambda path, ms: dict(run="r", path=path, median_ms=ms, model="glm5", experiment="paths",  # noqa: E731
                                env_timestamp="t", env_device_name="gpu", rel_err=1e-3)
    df = pd.DataFrame([rec("bf16_pool", 0.03), rec("full_pool_cast", 0.03 + added), rec("fp8_native", 0.03)])
    t = tables.step_table(df).set_index("path")
    assert t.tok_s.full_pool_cast == pytest.approx(10.5)
    assert t.step_ms.fp8_native == pytest.approx(stepmodel.rest_from_seed())
    assert t.layers.iloc[0] == 78 and math.isnan(t.seed_tok_s.fp8_native)
    assert tables.step_table(pd.DataFrame()).empty


def test_describe_and_memory_at_the_seed_scale(monkeypatch):
    from labkit import config, profiles

    monkeypatch.setattr(config, "_device_memory_bytes", lambda device: None)
    p = profiles.check(profiles.resolve("gpu-seed"))
    d = describe(p).set_index("quantity").value
    assert d["heads per GPU"].startswith("16 = 64 / tp 4") and "20.7" in d["pool, all layers"]
    mem = memory_table(p).set_index("path")
    assert mem.predicted_extra_bytes.full_pool_cast > 495_000 * 1152 > 50 * mem.predicted_extra_bytes.gather_cast
    assert torch.isnan(torch.tensor(mem.share_of_device.iloc[0]))


def test_peers_rows_are_checked_or_say_why():
    import importlib.util

    from labkit.config import LabParams

    p = LabParams.make(model="tiny", num_layers=1, pool_tokens=2048, page_size=16, batch_size=2,
                       context_lens=[70, 33], device="cpu")
    lab = Lab.build(p, warmup_ms=1, rep_ms=1)
    df = measure.peers(lab)
    assert list(df.label) == ["fp8_native.triton_q8 [FP8 pool]", "fp8_native.gluon [FP8 pool]",
                              "fp8_native.gluon_acc [FP8 pool]", "fp8_native.triton_rows [FP8 pool]",
                              "fp8_native.triton_rows_acc [FP8 pool]", "flashinfer_mla [FP8 pool]",
                              "flashinfer_mla [BF16 pool]", "flashinfer_mla_fp8 [FP8 pool]"]
    assert df.iloc[1:3].note.str.contains("needs a CUDA device").all()  # Gluon has no CPU interpreter
    ours = df.iloc[0]
    # FP8 query, one scale per request and head block: e4m3 rounding of q dominates (~6e-3)
    assert ours.note == "" and 0 < ours.rel_err < 2e-2 and ours.device_ms > 0
    if importlib.util.find_spec("flashinfer") is None:
        assert df.iloc[5:].note.str.contains("flashinfer").all()


def test_profiles_name_every_implementation_and_check_precision():
    from labkit import profiles

    impls = {r["impl"] for r in backends.capability_table()}
    assert impls <= set(profiles.IMPLS) and "gluon" in profiles.IMPLS
    assert profiles.resolve(None, {"impl": "gluon", "precision": "accurate"})["precision"] == "accurate"
    with pytest.raises(ValueError, match=r"precision='exact'; allowed: \['fast', 'accurate'\]"):
        profiles.resolve(None, {"precision": "exact"})
