"""Sparse (DSA top-k) batches and the 656-byte fp8_ds_mla rows through the torch and 16-bit Triton paths.

The float64 oracle is checked first against attention written out here over the gathered rows;
every path then against the oracle on the dequantized layer, for both FP8 layouts (and BF16 where
the path reads it). Triton runs in its CPU interpreter: tiny shapes. Outputs are poisoned (every
floating ``torch.empty`` starts as NaN), so a row a kernel forgets to write fails.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labkit import backends, config, kvlayout, kvpool, memory, profiles, reference, roofline
from labkit.kernels.ds_mla_to_bf16 import ds_mla_to_bf16
from labkit.kernels.gather_cast import gather_cast

SM = 1 / 16
# bf16 output rounding (~2^-9 rms relative) dominates: the casts are exact (a ds_mla group scale is
# a power of two), the attention runs in fp32. Same floor as tests/test_paths.py.
TOL = 4e-3
TOL_SOURCE = 6e-2  # against the unquantized data: e4m3 rounding (~2^-5 rms per value)
CAST_PATHS = ["full_pool_cast.torch", "gather_cast.torch", "full_pool_cast.triton", "full_pool_cast.seed",
              "gather_cast.triton"]
BACKENDS = {  # layout -> the CPU backends that read it, for sparse batches
    "fp8_per_tensor": CAST_PATHS + ["fp8_native.torch"],
    "fp8_ds_mla": CAST_PATHS + ["fp8_native.torch"],
    "bf16": CAST_PATHS + ["bf16_pool.torch", "bf16_pool.triton"],
}


@pytest.fixture(autouse=True)
def _poison(poisoned):
    """Every test here runs with NaN-filled torch.empty (tests/conftest.py)."""


def _sparse_case(layout, page_size, lens, topk, heads=8, seed=0, layers=2):
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 3)
    pool, src = kvpool.random_pool(layers, ptok, page_size, kv_layout=layout, return_source=True, seed=seed)
    batch = kvpool.sparse_batch_for_pool(pool, lens, topk, seed=seed + 1, per_layer=True)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=seed + 2)
    return pool, src, batch, qn, qp


def _context_ids(batch, b):
    """Request b's global token ids, from its page table, written out independently."""
    pages = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].tolist()
    ids = [p * batch.page_size + s for p in pages for s in range(batch.page_size)]
    return ids[: int(batch.kv_lens[b])]


# ------------------------------------------------------------------ slots --------------------------
@settings(max_examples=25, deadline=None)
@given(page_log=st.integers(0, 6), lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
       topk=st.integers(1, 200), seed=st.integers(0, 1000))
def test_random_slots_are_distinct_tokens_of_the_own_context(page_log, lens, topk, seed):
    ps = 2**page_log
    batch = kvpool.make_batch(sum(-(-n // ps) for n in lens) + 7, ps, lens, seed=seed)
    slots = kvpool.random_slots(batch, topk, seed=seed)
    assert slots.dtype == torch.int32 and slots.shape == (len(lens), topk)
    for b, n in enumerate(lens):
        row = slots[b].tolist()
        k = min(n, topk)
        assert all(t >= 0 for t in row[:k]) and all(t == -1 for t in row[k:])  # -1s only at the end
        assert len(set(row[:k])) == k and set(row[:k]) <= set(_context_ids(batch, b))
    assert torch.equal(slots, kvpool.random_slots(batch, topk, seed=seed))  # reproducible
    assert batch.with_slots(slots).tokens_read == sum(min(n, topk) for n in lens)
    assert batch.tokens_read == batch.num_tokens == sum(lens)


def test_random_slots_per_layer_unsorted_and_refusals():
    batch = kvpool.make_batch(64, 16, [500, 40], seed=3)
    per = kvpool.random_slots(batch, 64, seed=1, num_layers=3)
    assert per.shape == (3, 2, 64)
    assert not torch.equal(per[0, 0], per[1, 0])  # an independent draw per layer
    first = per[0, 0]
    assert not torch.equal(first, first.sort().values)  # drawn, not sorted
    assert set(per[0, 1, :40].tolist()) == set(_context_ids(batch, 1))  # a short context: all of it
    sb = kvpool.make_sparse_batch(64, 16, [500, 40], 64, seed=3, num_layers=3)
    assert sb.topk == 64 and sb.slots(2).shape == (2, 64) and sb.tokens_read == 64 + 40
    with pytest.raises(ValueError, match="topk=0"):
        kvpool.random_slots(batch, 0)
    with pytest.raises(ValueError, match="num_layers"):
        kvpool.random_slots(batch, 8, num_layers=0)


# ------------------------------------------------------------------ oracle -------------------------
def test_oracle_sparse_is_attention_over_the_gathered_rows():
    pool, src, batch, qn, qp = _sparse_case("fp8_ds_mla", 16, [300, 20, 77], 48, heads=3)
    kv = src[1].double()  # [num_pages, page_size, 576]
    slots = batch.slots(1)
    out = reference.mla_decode(qn, qp, kv, batch.with_slots(slots), SM)
    flat = kv.reshape(-1, 576)
    for b in range(3):
        ids = [t for t in slots[b].tolist() if t >= 0]
        rows = torch.stack([flat[t] for t in ids])  # [n, 576]
        q = torch.cat([qn[b], qp[b]], -1).double()  # [H, 576]
        s = torch.einsum("hd,nd->hn", q, rows) * SM
        p = torch.exp(s - s.max(-1, keepdim=True).values)
        want = (p / p.sum(-1, keepdim=True)) @ rows[:, :512]
        torch.testing.assert_close(out[b], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="token_indices"):
        reference.mla_decode(qn, qp, kv, batch, SM)  # per-layer slots: the oracle wants one layer's


def test_oracle_with_every_token_selected_equals_dense():
    pool, src, _, qn, qp = _sparse_case("fp8_per_tensor", 8, [37, 5], 64, heads=2)
    dense = kvpool.batch_for_pool(pool, [37, 5], seed=1)
    slots = torch.full((2, 64), -1, dtype=torch.int32)
    for b in range(2):
        ids = _context_ids(dense, b)[::-1]  # all of it, in another order
        slots[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    a = reference.mla_decode(qn, qp, src[0], dense, SM)
    b = reference.mla_decode(qn, qp, src[0], dense.with_slots(slots), SM)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ paths --------------------------
@pytest.mark.parametrize("layout", list(BACKENDS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_sparse_paths_match_the_oracle(layout, page_size):
    # request 1 is shorter than topk: padded with -1s that no path may read
    pool, src, batch, qn, qp = _sparse_case(layout, page_size, [150, 20, 64], 32, seed=page_size)
    layer = 1
    one = batch.with_slots(batch.slots(layer))
    ref = reference.mla_decode(qn, qp, pool.dequant(layer, torch.float64), one, SM)
    ref_src = reference.mla_decode(qn, qp, src[layer], one, SM)
    outs = {}
    for name in BACKENDS[layout]:
        out = backends.get(name).decode(qn, qp, pool, layer, batch, SM)  # the plan picks layer 1's slots
        assert out.shape == qn.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all(), name
        assert reference.rel_err(out, ref) < TOL, name
        assert reference.rel_err(out, ref_src) < TOL_SOURCE, name
        outs[name] = out
    for impl in ("torch", "triton"):  # a gather of the rows equals the cast of the whole layer
        a, b = outs[f"full_pool_cast.{impl}"], outs[f"gather_cast.{impl}"]
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), impl


def test_explicit_slots_override_and_dense_layouts():
    """decode(token_indices=...) attends to those slots; a dense batch on a ds_mla pool still works."""
    pool, _, batch, qn, qp = _sparse_case("fp8_ds_mla", 16, [90, 40], 16, heads=4)
    mine = kvpool.random_slots(batch, 16, seed=99)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch.with_slots(mine), SM)
    dense = kvpool.batch_for_pool(pool, [90, 40], seed=1)
    ref_dense = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), dense, SM)
    for name in ("full_pool_cast.torch", "fp8_native.torch", "gather_cast.triton", "full_pool_cast.triton"):
        b = backends.get(name)
        assert reference.rel_err(b.decode(qn, qp, pool, 0, batch, SM, token_indices=mine), ref) < TOL, name
        assert reference.rel_err(b.decode(qn, qp, pool, 0, dense, SM), ref_dense) < TOL, name


def test_rules_refuse_what_a_backend_does_not_take():
    pool, _, batch, qn, _ = _sparse_case("fp8_ds_mla", 16, [40], 8, heads=4, layers=1)
    with pytest.raises(ValueError, match="dense.*sparse"):
        backends.get("fp8_native.triton").check(qn, kvpool.random_pool(1, 64, 16), batch)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        backends.get("fp8_native.triton").check(qn, pool)
    with pytest.raises(ValueError, match="bf16"):
        backends.get("bf16_pool.triton").check(qn, pool, batch)
    rows = {r["backend"]: r for r in backends.capability_table()}
    for name in CAST_PATHS:
        assert rows[name]["batches"] == "dense/sparse" and "fp8_ds_mla" in rows[name]["kv_layouts"], name


# ------------------------------------------------------------------ kernels ------------------------
@pytest.mark.parametrize("tuning", [{}, dict(rows=4, num_warps=2, scale4=True), dict(rows=2, scale4=False)])
def test_ds_mla_to_bf16_is_exact_whole_and_gathered(tuning):
    pool = kvpool.random_pool(1, 256, 16, kv_layout="fp8_ds_mla", seed=4)
    layer = pool.layer(0)  # [16, 16, 656] uint8
    want = kvlayout.dequant_ds_mla(layer, torch.float32)  # e4m3 x power of two: exact in bf16
    assert torch.equal(ds_mla_to_bf16(layer, **tuning).float(), want)
    pages = torch.tensor([5, -1, 0, 15, 5], dtype=torch.int32)
    got = ds_mla_to_bf16(layer, pages, **tuning)
    assert got.shape == (5, 16, 576) and torch.equal(got[1], torch.zeros(16, 576, dtype=torch.bfloat16))
    assert torch.equal(got[[0, 2, 3, 4]].float(), want[[5, 0, 15, 5]])
    ids = torch.tensor([255, 3, -1, 17], dtype=torch.int32)
    got = ds_mla_to_bf16(pool.rows(0)[:, None], ids, **tuning)  # a sparse batch's rows as one-token pages
    flat = want.flatten(0, 1)
    assert torch.equal(got[:, 0].float(), torch.stack([flat[255], flat[3], torch.zeros(576), flat[17]]))
    with pytest.raises(ValueError, match="packed"):
        ds_mla_to_bf16(layer[..., :576])
    with pytest.raises(ValueError, match="kv_indices"):
        ds_mla_to_bf16(layer, pages.long())


def test_gather_cast_skips_minus_one():
    pool = kvpool.random_pool(1, 256, 16, seed=5)
    ids = torch.tensor([7, -1, 250], dtype=torch.int32)
    got = gather_cast(pool.rows(0)[:, None], ids)
    want = pool.rows(0)[[7, 0, 250]].to(torch.bfloat16)[:, None]
    want[1] = 0
    assert torch.equal(got, want)


# ------------------------------------------------------------------ bytes --------------------------
def test_bytes_per_token_by_layout():
    P, lens, topk = 495_000, [100, 3000, 2048], 2048
    batch = kvpool.make_sparse_batch(64, 64, [10, 300], 64, seed=0)
    assert batch.tokens_read == 10 + 64 and batch.num_tokens == 310
    L = sum(min(n, topk) for n in lens)  # 100 + 2048 + 2048
    for layout, row in (("fp8_per_tensor", 576), ("fp8_ds_mla", 656), ("bf16", 1152)):
        kw = dict(kv_layout=layout, kv_dtype="bf16" if layout == "bf16" else "fp8_e4m3")
        assert roofline.path_bytes("fp8_native", P, L, **kw) == L * row
        assert roofline.path_bytes("bf16_pool", P, L, **kw) == L * 1152
        cast = 0 if layout == "bf16" else row + 1152
        assert roofline.path_bytes("full_pool_cast", P, L, **kw) == P * cast + L * 1152
        copy = 1152 * 2 if layout == "bf16" else cast  # a BF16 pool's gather is still a copy
        assert roofline.path_bytes("gather_cast", P, L, **kw) == L * (copy + 1152)
        full = memory.predicted_extra_bytes("full_pool_cast", P, L, 3, 16, **kw)
        assert full == (0 if layout == "bf16" else P * 1152) + 3 * 16 * 512 * 2
    assert roofline.stored_row_bytes("fp8_ds_mla") == kvlayout.KV_LAYOUTS["fp8_ds_mla"]
    with pytest.raises(ValueError, match="kv_layout"):
        roofline.path_bytes("fp8_native", P, L, kv_layout="fp4")


def test_sparse_gather_copy_depends_on_topk_not_the_context():
    def extra(lens):
        pool = kvpool.random_pool(1, 2048, 16, kv_layout="fp8_ds_mla")
        batch = kvpool.sparse_batch_for_pool(pool, lens, 32)
        qn, qp = kvpool.make_queries(2, 4)
        b = backends.get("gather_cast.torch")
        return memory.extra_memory(lambda: b.decode(qn, qp, pool, 0, batch, SM), "cpu")

    short, long = extra([100, 100]), extra([900, 900])
    assert short == long
    assert short >= memory.predicted_extra_bytes("gather_cast", 2048, 2 * 32, 2, 4, kv_layout="fp8_ds_mla")


# ------------------------------------------------------------------ parameters ---------------------
def test_lab_params_kv_layout(monkeypatch):
    monkeypatch.setattr(config, "_device_memory_bytes", lambda device: None)
    p = config.LabParams.make(model="glm5", num_layers=2, pool_tokens=4096, device="cpu", kv_layout="fp8_ds_mla")
    assert p.pool_bytes == 2 * 4096 * 656 and p.as_dict()["kv_layout"] == "fp8_ds_mla"
    assert config.LabParams.make(device="cpu", kv_dtype="bf16").kv_layout == "bf16"  # None: kv_dtype's own
    assert config.LabParams.make(device="cpu").kv_layout == "fp8_per_tensor"
    with pytest.raises(ValueError, match=r"kv_layout='fp8_ds_mla'.*kv_dtype='bf16'"):
        config.LabParams.make(device="cpu", kv_dtype="bf16", kv_layout="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"kv_layout='bf16'.*kv_dtype='fp8_e4m3'"):
        config.LabParams.make(device="cpu", kv_layout="bf16")
    with pytest.raises(ValueError, match=r"kv_layout='fp8'.*allowed"):
        config.LabParams.make(device="cpu", kv_layout="fp8")
    assert profiles.check(profiles.resolve("cpu-small", {"kv_layout": "fp8_ds_mla"})).kv_layout == "fp8_ds_mla"


def test_lab_builds_the_layout_and_its_bf16_copy(tmp_path):
    from labkit.lab import Lab, oracle

    p = config.LabParams.make(num_layers=1, pool_tokens=512, page_size=16, batch_size=2, context_lens=60,
                              device="cpu", kv_layout="fp8_ds_mla")
    lab = Lab.build(p, tmp_path)
    assert lab.pool.kv_layout == "fp8_ds_mla" and lab.pool.kv_buffer.shape[-1] == 656
    on = lab.bf16()
    assert on.pool.kv_layout == "bf16"
    torch.testing.assert_close(on.pool.layer(0).float(), lab.pool.dequant(0), rtol=0, atol=0)
    out = on.decode(backends.get("bf16_pool.torch"))
    assert reference.rel_err(out, oracle(lab)) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["fp8_per_tensor", "fp8_ds_mla"])
def test_sparse_paths_on_cuda_at_glm5_topk(layout):
    """GLM-5's top-2048 on pages of 64, 16 heads; one request shorter than topk. BF16 tensor-core
    operands add ~1e-3 to the output rounding."""
    lens = [5000, 700, 3000]
    pool = kvpool.random_pool(1, 64 * 160, 64, kv_layout=layout, device="cuda", seed=1)
    batch = kvpool.sparse_batch_for_pool(pool, lens, 2048, seed=2)
    qn, qp = kvpool.make_queries(3, 16, device="cuda")
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM)
    for name in BACKENDS[layout]:
        out = backends.get(name).decode(qn, qp, pool, 0, batch, SM)
        assert reference.rel_err(out, ref) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scale4", [True, False])
def test_gpu_ds_mla_to_bf16_is_exact(scale4):
    """The compiled kernel (both ways of applying the group scales) against the torch dequantization:
    131,072 random rows of a 1M-token pool, -1 ids included, and the whole layer."""
    pool = kvpool.random_pool(1, 1 << 20, 1, device="cuda", kv_layout="fp8_ds_mla", seed=5)
    rows = pool.rows(0)
    ids = torch.randint(-1, 1 << 20, (131072,), dtype=torch.int32, device="cuda")
    got = ds_mla_to_bf16(rows[:, None], ids, scale4=scale4)[:, 0].float()
    want = kvlayout.dequant_ds_mla(rows[ids.long().clamp_min(0)], torch.float32) * (ids >= 0)[:, None]
    assert torch.equal(got, want)
    whole = ds_mla_to_bf16(pool.layer(0), scale4=scale4).float()
    assert torch.equal(whole, kvlayout.dequant_ds_mla(pool.layer(0), torch.float32))
