"""The benchmark entry point on a CPU: it checks, times and records; it proves no speed here."""
import json

import pandas as pd
import pytest
import torch

from labkit import backends, bench, preferences, roofline

CPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    if not CPU:
        pytest.skip("CUDA is available here")
    out = tmp_path_factory.mktemp("bench")
    rc = bench.main(["--grid", "cpu", "--run-dir", str(out),
                     "--providers", "full_pool_cast.torch", "fp8_native.torch", "flashinfer_mla_fp8"])
    assert rc == 0
    return out, pd.read_parquet(out / "bench.parquet")


def test_cpu_bench_records_checked_rows(cpu_run, capsys):
    _, df = cpu_run
    assert set(df["label"]) == {"full_pool_cast.torch", "fp8_native.torch", "flashinfer_mla_fp8"}
    assert len(df) == 3 * len(bench.GRIDS["cpu"])
    ours = df[df.label != "flashinfer_mla_fp8"]
    assert (ours["rel_err"] < 5e-3).all() and (ours["median_ms"] > 0).all()
    assert (ours["env_torch"].str.len() > 0).all() and (ours["timing_device"] == "cpu").all()
    row = ours[(ours.label == "fp8_native.torch") & (ours["shape"] == "mem")].iloc[0]
    assert row["bytes"] == roofline.path_bytes("fp8_native", row.pool_tokens, 2 * 300, heads=4, batch=2)


def test_rows_carry_precision_topk_layout_and_the_three_timings(cpu_run):
    _, df = cpu_run
    ours = df[df.label != "flashinfer_mla_fp8"]
    assert (ours.precision == [backends.get(b).precision_on(k) for b, k in zip(ours.backend, ours.kv_layout)]).all()
    dense, sparse = ours[ours["shape"] != "sparse"], ours[ours["shape"] == "sparse"]
    assert (dense.topk == 0).all() and (sparse.topk == 64).all()
    assert set(sparse.kv_layout) == {"fp8_per_tensor", "fp8_ds_mla"} and set(dense.kv_layout) == {"fp8_per_tensor"}
    assert (ours.graph_us > 0).all() and (ours.host_us > 0).all() and (ours.graph_method == "perf_counter").all()
    # a sparse row counts the bytes of the slots it reads, not of the contexts
    s = sparse[(sparse.label == "fp8_native.torch") & (sparse.kv_layout == "fp8_per_tensor")].iloc[0]
    assert s["bytes"] == roofline.path_bytes("fp8_native", s.pool_tokens, 2 * 64, heads=4, batch=2)


def test_a_peer_that_is_not_here_is_a_row_saying_why(cpu_run):
    _, df = cpu_run
    fi = df[df.label == "flashinfer_mla_fp8"]
    assert fi.median_ms.isna().all() and (fi.note.str.len() > 0).all()
    assert fi.note.str.contains("flashinfer|CUDA").all()


def test_preference_table_from_bench_records(cpu_run, tmp_path):
    _, df = cpu_run
    ours = df[df.graph_us.notna()]
    paths = bench.write_select(df.assign(graph_us=df.graph_us), tmp_path, False, "sm_90", "test run")
    table = json.loads(paths[0].read_text())
    assert paths[0].parent == tmp_path and table["arch"] == "sm_90" and table["source"] == "test run"
    for r in table["rows"]:
        sel = ours[(ours.path == r["path"]) & ((ours.topk > 0) == r["sparse"])
                   & (ours.kv_layout == r.get("kv_layout", "fp8_per_tensor"))]
        if r["precision"] == "accurate":
            sel = sel[sel.precision == "accurate"]
        med = sel.groupby("impl").graph_us.median().sort_values()
        assert r["order"] == list(med.index) and r["median_us"] == pytest.approx(list(med.round(2)), abs=0.01)
    assert preferences.order("fp8_native", "sm_90", 4, 2, False, "fast", tmp_path)[1] == "table"


def test_gpu_grid_refused_without_cuda(capsys):
    if not CPU:
        pytest.skip("CUDA is available here")
    assert bench.main(["--grid", "gpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_shapes_fit_their_pools_and_cover_the_targets():
    for grid in bench.GRIDS.values():
        for s in grid:
            assert s.pool() >= s.batch * -(-s.ctx // s.page_size) * s.page_size
            assert s.pool() % s.page_size == 0
    gpu = {(s.heads, s.batch, s.ctx, s.topk, s.kv_layout) for s in bench.GRIDS["gpu"]}
    for h, b, c in [(16, 64, 8192), (64, 64, 8192), (128, 64, 8192), (16, 32, 32768), (64, 1, 8192), (128, 1, 8192)]:
        assert (h, b, c, 0, "fp8_per_tensor") in gpu
    for h, b in [(16, 64), (64, 64), (128, 128)]:  # the sparse targets of the FP8-native issue
        for layout in ("fp8_per_tensor", "fp8_ds_mla"):
            assert (h, b, 32768, 2048, layout) in gpu


def test_providers_measure_every_implementation_and_the_peers():
    gpu = {p[1] for p in bench.providers("cuda")}
    assert {n for n in backends.names() if backends.get(n).impl not in ("torch", "flashinfer")} - set(bench.GPU_SKIP) <= gpu
    assert {"flashinfer_mla", "flashinfer_mla_fp8"} <= gpu and not any(n.endswith(".torch") for n in gpu)
    assert {p[1] for p in bench.providers("cpu")} >= {"fp8_native.torch", "fp8_native.triton"}


def test_labkit_bench_is_the_same_entry_point(capsys):
    from labkit import cli

    if not CPU:
        pytest.skip("CUDA is available here")
    assert cli.main(["bench", "--grid", "gpu"]) == 2
    assert "--grid gpu needs a CUDA device" in capsys.readouterr().err


def test_host_table_sets_ours_beside_flashinfer_at_one_request():
    df = pd.DataFrame([dict(shape="one", heads=16, label=lab, host_us=us) for lab, us in
                       [("fp8_native.gluon", 40.0), ("flashinfer_mla[bf16]", 60.0), ("flashinfer_mla_fp8", 80.0),
                        ("bf16_pool.triton", 90.0)]] + [dict(shape="mem", heads=16, label="fp8_native.gluon", host_us=1.0)])
    t = bench.host_table(df)
    assert t.loc[16, "fp8_native.gluon"] == 40.0  # the batched shape is not in it
    assert t.loc[16, "x_flashinfer fp8_native.gluon"] == pytest.approx(40 / 60, abs=0.01)
    assert t.loc[16, "x_flashinfer bf16_pool.triton"] == pytest.approx(1.5)


def test_side_by_side_host_time_calls_each_providers_own_plan(monkeypatch, tmp_path):
    """At one request the host times of all providers are taken in one interleaved loop after the
    last provider is planned: each label's calls must still run that provider's own plan."""
    if not CPU:
        pytest.skip("CUDA is available here")
    real_run, last = backends.DecodePlan.run, []

    def spy(self, *a, **k):
        last.append(self)
        return real_run(self, *a, **k)

    ran = {}

    def side_by_side(fns, **kw):
        for name, fn in fns.items():
            fn(0)
            ran[name] = last[-1]
        return {name: float(i + 1) for i, name in enumerate(fns)}

    monkeypatch.setattr(backends.DecodePlan, "run", spy)
    monkeypatch.setattr(bench.timing, "host_us_interleaved", side_by_side)
    shape = bench.GRIDS["cpu"][1]
    assert shape.batch == 1
    provs = [p for p in bench.providers("cpu") if p[0] in ("full_pool_cast.torch", "fp8_native.torch")]
    rows = bench.run_shape(shape, provs, "cpu", roofline.measure_ceilings("cpu", cache_dir=tmp_path))
    assert ran["full_pool_cast.torch"] is not ran["fp8_native.torch"]
    assert [r["host_us"] for r in rows] == [1.0, 2.0]
