"""FlashInfer peers: listed with a reason when absent; on a GPU with FlashInfer, checked against the oracle."""
import importlib.util

import pytest
import torch

from labkit import backends, kvpool, reference

HAS_FI = importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(HAS_FI, reason="flashinfer is installed here")
def test_absent_flashinfer_is_listed_with_reason():
    rows = {r["backend"]: r for r in backends.capability_table()}
    for name, path in [("flashinfer_mla", "full_pool_cast"), ("flashinfer_mla_fp8", "fp8_native")]:
        assert rows[name]["available"] is False and rows[name]["path"] == path
        assert "flashinfer" in rows[name]["note"]
        with pytest.raises(ValueError, match=f"{name}.*not available here.*flashinfer"):
            backends.get(name)
    assert backends.get("fp8_native", device="cpu").impl != "flashinfer"  # nothing else changes


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_FI and torch.cuda.is_available()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("name, kv_dtype", [("flashinfer_mla", "fp8_e4m3"), ("flashinfer_mla", "bf16"),
                                            ("flashinfer_mla_fp8", "fp8_e4m3")])
def test_flashinfer_matches_oracle(name, kv_dtype):
    pool = kvpool.random_pool(1, 64 * 400, 64, kv_dtype=kv_dtype, device="cuda", seed=1)
    batch = kvpool.batch_for_pool(pool, [1, 63, 64, 65, 3000, 8192], seed=2)
    qn, qp = kvpool.make_queries(6, 16, device="cuda")
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, 1 / 16)
    out = backends.get(name).decode(qn, qp, pool, 0, batch, 1 / 16)
    assert reference.rel_err(out, ref) < 1e-2


def test_slot_counts_and_gather_index_pack_valid_slots_by_request():
    from labkit import peers

    slots = torch.tensor([[5, 9, -1, -1], [7, 1, 3, 2], [-1, -1, -1, -1]], dtype=torch.int32)
    assert peers.slot_counts(slots) == [2, 4, 0]
    idx = peers.slot_gather_index(slots)
    assert idx.tolist() == [0, 1, 4, 5, 6, 7]
    assert slots.flatten()[idx].tolist() == [5, 9, 7, 1, 3, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_FI and torch.cuda.is_available()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("name, kv_dtype", [("flashinfer_mla", "fp8_e4m3"), ("flashinfer_mla", "bf16"),
                                            ("flashinfer_mla_fp8", "fp8_e4m3")])
@pytest.mark.parametrize("sparse", [False, True])
def test_flashinfer_plans_once_and_matches_oracle_in_every_layer(name, kv_dtype, sparse):
    page = 1 if sparse else 64
    pool = kvpool.random_pool(3, 64 * 300, page, kv_dtype=kv_dtype, device="cuda", seed=1)  # 3 k_scales
    lens = [1, 63, 3000, 8192]
    batch = (kvpool.sparse_batch_for_pool(pool, lens, 2048, seed=2, per_layer=True) if sparse
             else kvpool.batch_for_pool(pool, lens, seed=2))
    qn, qp = kvpool.make_queries(len(lens), 16, device="cuda")
    b = backends.get(name)
    plan = b.plan(pool, batch, 16, 1 / 16, qn.dtype)
    for layer in (2, 0, 1):
        one = batch.with_slots(batch.slots(layer)) if sparse else batch
        ref = reference.mla_decode(qn, qp, pool.dequant(layer, torch.float64), one, 1 / 16)
        assert reference.rel_err(plan.run(qn, qp, layer), ref) < 1e-2, (name, layer)
    assert b.plan(pool, batch, 16, 1 / 16, qn.dtype) is plan


def test_slots_with_minus_ones_anywhere_are_packed_in_order():
    from types import SimpleNamespace

    from labkit import peers

    first = torch.tensor([[5, 9, -1, -1], [7, 1, 3, 2]], dtype=torch.int32)
    mixed = torch.tensor([[-1, 5, -1, 9], [7, 1, 3, 2]], dtype=torch.int32)
    assert peers.valid_first(first) and not peers.valid_first(mixed)
    assert peers.valid_first(torch.stack([first, first])) and not peers.valid_first(torch.stack([first, mixed]))
    gather = peers.slot_gather_index(first)
    out = torch.empty(6, dtype=torch.int32)
    peers._set_slots(out, gather, SimpleNamespace(token_indices=mixed), packed=False)
    assert out.tolist() == [5, 9, 7, 1, 3, 2]
    peers._set_slots(out.zero_(), gather, SimpleNamespace(token_indices=first), packed=True)
    assert out.tolist() == [5, 9, 7, 1, 3, 2]
