"""labkit.dsa: the DSA step model's arithmetic, its profile, and the sparse step's outputs against
the float64 oracle on tiny cases (torch paths, and the Triton paths in the interpreter)."""
import json

import pandas as pd
import pytest
import torch

from labkit import backends, config, dsa, profiling, reference
from labkit.config import LabParams
from labkit.indexer import positions_of
from labkit.profiling import DSA_CATEGORIES

TOL = 4e-3  # a BF16 output against the float64 oracle (see test_paths.py)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _lab(kv_layout="fp8_per_tensor", lens=(100, 300, 65), page_size=32, index_topk=128, num_layers=2, **kw):
    """tiny, 8 heads; requests of 100 and 65 tokens are shorter than top-128 (-1 slots)."""
    p = LabParams.make(model="tiny", num_layers=num_layers, tp_size=2, pool_tokens=1024, page_size=page_size,
                       batch_size=len(lens), context_lens=list(lens), kv_layout=kv_layout, device="cpu")
    return dsa.build(p, index_topk=index_topk, warmup_ms=1, rep_ms=1, **kw)


# -- the step model, by hand -----------------------------------------------------------------------
def test_dsa_step_ms_by_hand():
    assert dsa.dsa_step_ms(2.0, 1.0, 78, 3, 30.0) == pytest.approx(3 * 2.0 + 75 * 1.0 + 30.0)  # 111
    assert dsa.dsa_step_ms(2.0, 1.0, 4, 0, 0.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="dense_layers=5"):
        dsa.dsa_step_ms(1.0, 1.0, 4, 5, 0.0)


def _profile(path, ms: dict, batch=4):
    cats = list(DSA_CATEGORIES)
    rows = [dict(category=c, ms_per_layer=ms.get(c, 0.0)) for c in cats]
    rows.append(dict(category="total", ms_per_layer=sum(ms.values())))
    return pd.DataFrame(rows).assign(path=path, backend=f"{path}.torch", batch_size=batch,
                                     kv_layout="fp8_per_tensor", topk=2048)


def test_step_model_by_hand():
    cfg = config.load_model("glm5")  # 78 layers, the first 3 dense
    prof = pd.concat([_profile("full_pool_cast", dict(index=0.05, topk=0.02, cast=0.9, attention=0.03)),
                      _profile("fp8_native", dict(index=0.05, topk=0.02, attention=0.04))])
    dense = pd.concat([_profile("full_pool_cast", dict(cast=0.9, attention=0.1)),
                       _profile("fp8_native", dict(attention=0.2))])
    steps = dsa.step_model(prof, dense, cfg, rest_ms=30.0).set_index("path")
    full = 3 * 1.0 + 75 * 1.0 + 30.0  # dense layer 1.0 ms, sparse layer 0.05 + 0.02 + 0.9 + 0.03 = 1.0 ms
    native = 3 * 0.2 + 75 * 0.11 + 30.0
    assert steps.step_ms.full_pool_cast == pytest.approx(full)
    assert steps.step_ms.fp8_native == pytest.approx(native)
    assert steps.tok_s.fp8_native == pytest.approx(4 * 1e3 / native)  # 4 requests, one token each per step
    assert steps.cast_share.full_pool_cast == pytest.approx((3 * 0.9 + 75 * 0.9) / full)
    assert steps.cast_share.fp8_native == 0 and steps.sparse_attn_ms.fp8_native == pytest.approx(0.04)
    assert (steps.layers == 78).all() and (steps.dense_layers == 3).all()


def test_cast_and_attention_bytes():
    assert dsa.cast_bytes(1000, "fp8_per_tensor") == 1000 * (576 + 1152)
    assert dsa.cast_bytes(1000, "fp8_ds_mla") == 1000 * (656 + 1152)
    assert dsa.attention_bytes(2048, "full_pool_cast", "fp8_ds_mla") == 2048 * 1152
    assert dsa.attention_bytes(2048, "fp8_native", "fp8_ds_mla") == 2048 * 656
    assert dsa.attention_bytes(2048, "fp8_native", "fp8_per_tensor") == 2048 * 576


def test_fit_layers(monkeypatch):
    monkeypatch.setattr(config, "_device_memory_bytes", lambda device: 141 * 10**9)
    per_layer = 64 * 131072 * (576 + 128 + 4)  # KV rows and index keys of 64 x 128K tokens
    assert dsa.fit_layers(78, 64 * 131072, "fp8_per_tensor", 128, "cuda") == int(0.5 * 141e9 // per_layer) == 11
    assert dsa.fit_layers(4, 64 * 131072, "fp8_per_tensor", 128, "cuda") == 4
    assert dsa.fit_layers(78, 10**12, "fp8_per_tensor", 128, "cuda") == 1


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="index_topk=0"):
        dsa.model_cfg("tiny", index_topk=0)
    with pytest.raises(ValueError, match="index_n_heads=-2"):
        dsa.model_cfg("tiny", index_n_heads=-2)
    assert dsa.model_cfg("glm5", 512, 8).index_topk == 512 and dsa.model_cfg("glm5").index_n_heads == 32
    with pytest.raises(ValueError, match=r"topk_impl='heap'; allowed: \[None, 'torch', 'triton', 'cuda', 'candidates'\]"):
        _lab(topk_impl="heap")
    with pytest.raises(ValueError, match="topk_impl='candidates' needs the Triton indexer"):
        _lab(topk_impl="candidates")  # impl 'auto' on a CPU: the torch indexer


# -- the profile ------------------------------------------------------------------------------------
def test_profile_categories_sum_to_the_total(tmp_path):
    dl = _lab()
    for path in dsa.SPARSE_PATHS:
        trace = tmp_path / f"{path}.json"
        prof = dsa.profile_step(dl, dsa.pick(dl, path), repeats=1, trace_path=trace).set_index("category")
        events = json.loads(trace.read_text())["traceEvents"]  # the timed profile's Chrome trace
        assert any(e.get("name") == profiling.STEP_RANGE for e in events), path
        assert list(prof.index) == list(DSA_CATEGORIES) + ["total"]
        body = prof.drop("total")
        assert body.device_ms.sum() == pytest.approx(prof.device_ms["total"])
        assert body.share.sum() == pytest.approx(1.0)
        assert prof.ms_per_layer["total"] == pytest.approx(prof.device_ms["total"] / 2)  # 2 layers measured
        assert prof.device_ms["index"] > 0 and prof.device_ms["topk"] > 0 and prof.device_ms["attention"] > 0
        assert (prof.device_ms["cast"] > 0) == (path in ("full_pool_cast", "gather_cast")), path


def test_cast_under_dsa_counts_the_whole_pool():
    dl = _lab()
    cast = dsa.cast_under_dsa(dsa.profile_step(dl, dsa.pick(dl, "full_pool_cast"), repeats=1))
    assert cast["tokens_read"] == 100 + 128 + 65  # top-128, all of the shorter contexts
    assert cast["bytes_ratio"] == pytest.approx(1024 * (576 + 1152) / (293 * 1152))
    assert 0 < cast["cast_share"] < 1


# -- outputs against the float64 oracle ---------------------------------------------------------------
@pytest.mark.parametrize("kv_layout", ["fp8_per_tensor", "fp8_ds_mla"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sparse_step_matches_the_oracle(kv_layout, impl):
    dl = _lab(kv_layout, page_size=1 if impl == "triton" else 32)
    for path in dsa.SPARSE_PATHS:
        b = dsa.pick(dl, path, impl)
        lab = dsa.on_pool(dl, path)
        plan = b.plan(lab.pool, dl.sparse, lab.q_nope.shape[1], lab.sm_scale)
        for layer in range(dl.indexer.num_layers):
            kv_layer = layer % lab.pool.num_layers
            out = dsa.sparse_layer(dl, plan, layer, kv_layer)
            slots = dl.indexer.topk(layer)  # the indexer's own slots, validated
            assert (slots == dl.sparse.slots(layer)).all()
            assert (slots[0, 100:] == -1).all() and (slots[1] >= 0).all()
            kv = dl.lab.pool.dequant(kv_layer, torch.float64)  # the whole layer, independently of dsa.oracle
            ref = reference.mla_decode(lab.q_nope, lab.q_pe, kv, dl.sparse.with_slots(slots), lab.sm_scale)
            assert reference.rel_err(out, ref) < TOL, (b.name, layer)


def test_step_with_the_logits_kernels_candidates():
    """topk_impl='candidates': the step's slots come from the logits kernel's candidates; the same
    attention output as the oracle over those slots, and a top-k of the reference logits."""
    dl = _lab(lens=(100, 700, 65), page_size=16, impl="triton", topk_impl="candidates", num_layers=1)
    b = dsa.pick(dl, "fp8_native", "triton_rows_acc")
    plan = b.plan(dl.lab.pool, dl.sparse, dl.lab.q_nope.shape[1], dl.lab.sm_scale)
    out = dsa.sparse_layer(dl, plan, 0, 0)
    slots = dl.indexer.topk(0, "triton", topk_impl="candidates")  # validated by check_slots
    with pytest.raises(ValueError, match="topk_impl='candidates' needs impl='triton'"):
        dl.indexer.topk(0, "torch", topk_impl="candidates")
    ref_logits = dl.indexer.logits(0, "reference")
    kth = ref_logits[1].topk(128).values[-1]
    picked = ref_logits[1, positions_of(dl.indexer.batch, slots)[1]]
    assert (picked >= kth - 1e-4 * kth.abs()).all() and (slots[0, 100:] == -1).all()
    kv = dl.lab.pool.dequant(0, torch.float64)
    ref = reference.mla_decode(dl.lab.q_nope, dl.lab.q_pe, kv, dl.sparse.with_slots(slots), dl.lab.sm_scale)
    assert reference.rel_err(out, ref) < TOL


def test_compact_oracle_equals_the_whole_layer_oracle():
    dl = _lab("fp8_ds_mla")
    lab = dl.lab
    for batch in (dl.sparse, dl.sparse.with_slots(None)):
        kv = lab.pool.dequant(1, torch.float64)
        one = batch.with_slots(batch.slots(1)) if batch.topk else batch
        ref = reference.mla_decode(lab.q_nope, lab.q_pe, kv, one, lab.sm_scale)
        assert torch.allclose(dsa.oracle(lab, batch, layer=1), ref, rtol=1e-12, atol=1e-12)


def test_dense_and_sparse_rows():
    dl = _lab()
    rows = dsa.dense_and_sparse(dl, paths=("gather_cast", "fp8_native")).set_index(["path", "mode"])
    assert (rows.rel_err < TOL).all()
    assert rows.loc[("fp8_native", "sparse"), "tokens_read"] == 293 and rows.loc[("fp8_native", "dense"), "tokens_read"] == 465
    assert rows.loc[("fp8_native", "sparse"), "topk"] == 128 and rows.loc[("fp8_native", "dense"), "topk"] == 0


def test_peers_missing_here_say_why():
    if torch.cuda.is_available():
        pytest.skip("FlashInfer may be here: measured in notebook 05")
    rows = dsa.peers(_lab())
    assert len(rows) == 2 and rows.note.str.len().gt(0).all()


@pytest.mark.parametrize("name, notes, expected", [
    ("aten::mm", ("index",), "index"),  # the indexer's torch logits are matmuls, not attention
    ("aten::topk", ("topk",), "topk"),
    ("_index_logits_kernel", ("index", "labkit.decode_step"), "index"),
    ("aten::mm", (), "attention"),
])
def test_index_and_topk_ranges_set_the_category(name, notes, expected):
    from labkit.profiling import categorize

    assert categorize(name, "float", (), notes) == expected


def test_pick_with_peers_registered(monkeypatch):
    """A peer's name has no implementation suffix (FlashInfer's "flashinfer_mla"): where it is
    registered (a GPU machine with FlashInfer), picking a sparse path still works and never gives it."""
    from dataclasses import replace as dc_replace

    peer = dc_replace(backends.get("fp8_native.torch"), name="flashinfer_peer", impl="flashinfer")
    monkeypatch.setitem(backends.REGISTRY, peer.name, peer)
    dl = _lab()
    for path in dsa.SPARSE_PATHS:
        assert dsa.pick(dl, path).impl != "flashinfer"
