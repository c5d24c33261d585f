"""The Triton kernels (labkit.kernels) against the fp64 oracle, in the CPU interpreter.

Every run poisons the outputs (every floating ``torch.empty`` is NaN-filled), so an element a
kernel forgets to write fails the check. Inputs are fresh random draws; lengths include 1,
page - 1, page and page + 1 so that partial last pages and single-token requests are covered.
Tests marked ``gpu`` run the same checks on larger shapes on a CUDA device (skipped without one).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labkit import backends, kvpool, reference
from labkit.kernels import mla_decode as md
from labkit.kernels import mla_decode_fp8 as md8
from labkit.kernels.fp8_to_bf16 import fp8_to_bf16
from labkit.kernels import gather_cast as gather_k
from labkit.kernels.gather_cast import gather_cast
from labkit.kernels.mla_decode import mla_decode
from labkit.kernels.mla_decode_fp8 import mla_decode_fp8

SM = 1 / 16  # GLM-5's softmax scale
# In the interpreter the kernels compute in fp32 and the bf16 output is rounded to nearest once,
# so the error against the oracle is bf16 rounding of the output: ~2^-9 rms relative (the
# interpreter's own fp32 -> bf16 cast truncates; the kernels round first). Same floor as the
# torch paths (tests/test_paths.py).
TOL_BF16_OUT = 4e-3
TOL_FP16_OUT = 5e-4  # fp16 output: 2^-12 rounding
# An FP8 query (e4m3: 3 mantissa bits, one scale per request and head block) perturbs every
# score by up to 2^-4 relative: 2.5-3.4e-2 against the exact result (STUDY.md's emulation table;
# 2.7e-2 seen here at 129 tokens, 5 heads), most at short contexts.
TOL_Q8 = 4e-2
# Against the unquantized source the e4m3 rounding of KV (~2^-5 rms per value) dominates.
TOL_SOURCE = 6e-2
TOL_LSE = 1e-4  # absolute, natural log, fp32 arithmetic
TOL_LSE_Q8 = 0.15  # absolute: scores perturbed by the FP8 query
# On a GPU: bf16/fp16 tensor-core operands (p and the widened KV) add ~1e-3.
TOL_GPU = 1e-2
TOL_GPU_Q8 = 5e-2


@pytest.fixture(autouse=True)
def _poison(poisoned):
    """Every test here runs with NaN-filled torch.empty (tests/conftest.py)."""


def _case(page_size, lens, heads, seed, kv_dtype="fp8_e4m3", q_dtype=torch.bfloat16, device="cpu"):
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 3)
    pool, src = kvpool.random_pool(1, ptok, page_size, kv_dtype=kv_dtype, return_source=True, seed=seed,
                                   device=device)
    batch = kvpool.batch_for_pool(pool, lens, seed=seed + 1)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=seed + 2, dtype=q_dtype, device=device)
    return pool, src, batch, qn, qp


def _edge_lens(ps):
    return sorted({1, max(ps - 1, 1), ps, ps + 1})


def _idx(batch):
    return batch.kv_indptr, batch.kv_indices, batch.kv_lens


def _check(out, lse, ref, ref_lse, tol, tol_lse):
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    assert reference.rel_err(out, ref) < tol
    assert torch.isfinite(lse).all()
    assert float((lse.double().cpu() - ref_lse.double().cpu()).abs().max()) < tol_lse


# ------------------------------------------------------------------ casts -----------------------
@pytest.mark.parametrize("shape", [(7, 64, 576), (3, 1, 576), (5000,)])
@pytest.mark.parametrize("block", [1024, 8192])
def test_fp8_to_bf16_is_exact(shape, block):
    x = (torch.randn(shape) * 40).to(torch.float8_e4m3fn)
    y = fp8_to_bf16(x, block=block)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_gather_cast_is_exact(page_size):
    pool, _, batch, _, _ = _case(page_size, _edge_lens(page_size) + [200], 1, page_size)
    out = gather_cast(pool.layer(0), batch.kv_indices)
    assert torch.equal(out, pool.layer(0)[batch.kv_indices.long()].to(torch.bfloat16))


@pytest.mark.parametrize("block_c", [None, 64, 1024, 4096])
def test_gather_cast_rows_whole_or_in_blocks(block_c):
    """Sparse rows (one-token pages of 576 values): read whole (columns masked past 576) or in
    64-value blocks, the same exact copy; -1 ids give zero rows."""
    rows = (torch.randn(300, 1, 576) * 40).to(torch.float8_e4m3fn)
    ids = torch.tensor([5, -1, 299, 0, 17, 17, 123, -1, 64, 1], dtype=torch.int32)
    out = gather_cast(rows, ids, block_c=block_c)
    want = rows[ids.long().clamp_min(0)].to(torch.bfloat16) * (ids >= 0)[:, None, None]
    assert torch.equal(out, want)
    grid, meta = gather_k.launch_config(ids.numel(), 576, block_c=block_c)
    assert meta["MASK_C"] == (meta["BLOCK_C"] > 576) and grid[1] * meta["BLOCK_C"] >= 576
    assert (grid[1], meta["BLOCK_C"]) == ((1, 1024) if block_c in (None, 1024) else (-(-576 // block_c), block_c))


def test_gather_cast_block_c_rule():
    for bad in (0, 48, 128, 512):  # not a power of two, or one that leaves a partial block
        with pytest.raises(ValueError, match=f"block_c={bad}"):
            gather_k.launch_config(4, 576, block_c=bad)


def test_cast_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="x has dtype"):
        fp8_to_bf16(torch.zeros(4))
    kv = torch.zeros(4, 2, 576).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_indices has dtype"):
        gather_cast(kv, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_buffer has dtype"):
        gather_cast(kv.float(), torch.zeros(3, dtype=torch.int32))


# ------------------------------------------------------------------ 16-bit decode ---------------
@pytest.mark.parametrize("page_size,heads,splits", [(1, 1, None), (16, 16, 3), (64, 8, 1), (128, 128, 2)])
def test_mla_decode_16bit_matches_oracle(page_size, heads, splits):
    lens = _edge_lens(page_size) + [300]
    pool, _, batch, qn, qp = _case(page_size, lens, heads, page_size + heads, kv_dtype="bf16")
    kv = pool.layer(0)
    ref, ref_lse = reference.mla_decode(qn, qp, kv.double(), batch, SM, return_lse=True)
    out, lse = mla_decode(qn, qp, kv, *_idx(batch), SM, num_splits=splits, return_lse=True)
    assert out.shape == qn.shape and out.dtype == torch.bfloat16 and lse.shape == (len(lens), heads)
    _check(out, lse, ref, ref_lse, TOL_BF16_OUT, TOL_LSE)


def test_mla_decode_fp16_and_v_scale():
    pool, _, batch, qn, qp = _case(16, [1, 15, 16, 17, 90], 16, 3, kv_dtype="bf16", q_dtype=torch.float16)
    kv = pool.layer(0).to(torch.float16)
    ref, ref_lse = reference.mla_decode(qn, qp, kv.double(), batch, SM, return_lse=True)
    out, lse = mla_decode(qn, qp, kv, *_idx(batch), SM, v_scale=0.5, num_splits=2, return_lse=True)
    _check(out, lse, ref * 0.5, ref_lse, TOL_FP16_OUT, TOL_LSE)


def test_mla_decode_refuses_fp8_before_any_launch(monkeypatch):
    pool, _, batch, qn, qp = _case(16, [20], 4, 0)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched")

    monkeypatch.setattr(md, "_mla_decode_kernel", NoLaunch())
    with pytest.raises(ValueError, match=r"mla_decode.*float8_e4m3fn.*16-bit"):
        mla_decode(qn, qp, pool.layer(0), *_idx(batch), SM)


def test_empty_request_gives_zero_and_minus_inf():
    pool, _, batch, qn, qp = _case(16, [40, 1], 4, 5)
    # request 1 reads no page and no token
    indptr = torch.tensor([0, 3, 3], dtype=torch.int32)
    lens = torch.tensor([40, 0], dtype=torch.int32)
    for kv, fn in ((pool.layer(0).to(torch.bfloat16), mla_decode), (pool.layer(0), mla_decode_fp8)):
        for splits in (1, 2):
            out, lse = fn(qn, qp, kv, indptr, batch.kv_indices[:3].contiguous(), lens, SM, num_splits=splits,
                          return_lse=True)
            assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == -float("inf")).all()
            assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("bad,match", [
    (dict(kv_indices=torch.zeros(3, dtype=torch.int64)), "kv_indices has dtype"),
    (dict(kv_indptr=torch.zeros(5, dtype=torch.int32)), "kv_indptr must be 1-D with 3 entries"),
    (dict(q_pe=torch.zeros(2, 4, 32, dtype=torch.bfloat16)), "q_pe must be"),
    (dict(kv_buffer=torch.zeros(8, 3, 576, dtype=torch.bfloat16)), "page_size=3"),
    (dict(q_nope=torch.zeros(2, 129, 512, dtype=torch.bfloat16),
          q_pe=torch.zeros(2, 129, 64, dtype=torch.bfloat16)), "129 heads"),
])
def test_decode_argument_errors_name_the_argument(bad, match):
    args = dict(q_nope=torch.zeros(2, 4, 512, dtype=torch.bfloat16), q_pe=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                kv_buffer=torch.zeros(8, 4, 576, dtype=torch.bfloat16), kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
                kv_indices=torch.tensor([0, 1], dtype=torch.int32), kv_lens=torch.tensor([3, 4], dtype=torch.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mla_decode(**args, sm_scale=SM)
    args["kv_buffer"] = args["kv_buffer"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=match):
        mla_decode_fp8(**args, sm_scale=SM)


# ------------------------------------------------------------------ FP8 decode ------------------
# The structural variants run in the interpreter too (widening is fp32 there): the split logic,
# the page walk (tiles within a page or across pages), the swapped orientation and the FP8 query.
VARIANTS = {
    "plain": dict(q_fp8=False),
    "swap1": dict(q_fp8=False, swap=1, block_n=64),
    "n32": dict(q_fp8=False, block_n=32),  # a tile inside one page of 64
    "q8_swap1": dict(q_fp8=True, swap=1, block_n=64),
    "default": dict(),  # the GPU default's numerics: FP8 query
}


# Every variant at page 1 (tiles across pages, masked heads) and page 64; at page 128 with two head
# blocks of 64 and three splits, a bf16 and an FP8 query in each orientation: there swap1 and n32
# would only repeat paths these cover (q loads and the tile-in-a-page walk do not depend on Q_FP8)
FP8_CASES = ([(v, 1, 3, 2) for v in VARIANTS] + [(v, 64, 16, None) for v in VARIANTS]
             + [(v, 128, 128, 3) for v in ("plain", "q8_swap1", "default")])


@pytest.mark.parametrize("variant,page_size,heads,splits", FP8_CASES)
def test_mla_decode_fp8_matches_oracle(variant, page_size, heads, splits):
    kw = VARIANTS[variant]
    lens = _edge_lens(page_size) + [257]
    pool, src, batch, qn, qp = _case(page_size, lens, heads, 11 * page_size + heads)
    ref, ref_lse = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM, return_lse=True)
    ref_src = reference.mla_decode(qn, qp, src[0].double(), batch, SM)
    out, lse = mla_decode_fp8(qn, qp, pool.layer(0), *_idx(batch), SM, pool.scale(0), num_splits=splits,
                              return_lse=True, **kw)
    q8 = kw.get("q_fp8", True)
    assert out.dtype == qn.dtype and out.shape == qn.shape
    _check(out, lse, ref, ref_lse, TOL_Q8 if q8 else TOL_BF16_OUT, TOL_LSE_Q8 if q8 else TOL_LSE)
    assert reference.rel_err(out, ref_src) < TOL_SOURCE


def test_fp8_scales_are_folded_not_ignored():
    """k_scale in the scores, v_scale (its own value when given) on the output."""
    pool, _, batch, qn, qp = _case(16, [33, 90], 8, 1)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM)
    raw = reference.mla_decode(qn, qp, pool.layer(0).double(), batch, SM)
    out = mla_decode_fp8(qn, qp, pool.layer(0), *_idx(batch), SM, pool.scale(0), q_fp8=False)
    assert reference.rel_err(raw, ref) > 0.3 and reference.rel_err(out, ref) < TOL_BF16_OUT
    out2 = mla_decode_fp8(qn, qp, pool.layer(0), *_idx(batch), SM, pool.scale(0), v_scale=2 * pool.scale(0),
                          q_fp8=False)
    assert reference.rel_err(out2, 2 * ref) < TOL_BF16_OUT


@settings(max_examples=10, deadline=None)
@given(page_log=st.integers(0, 7), lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
       heads=st.sampled_from([1, 5, 16, 64, 128]), splits=st.sampled_from([None, 1, 2, 5]),
       q8=st.booleans(), seed=st.integers(0, 10_000))
def test_random_batches_fp8_and_16bit(page_log, lens, heads, splits, q8, seed):
    ps = 2**page_log
    pool, _, batch, qn, qp = _case(ps, lens, heads, seed)
    deq = pool.dequant(0, torch.float64)
    ref, ref_lse = reference.mla_decode(qn, qp, deq, batch, SM, return_lse=True)
    out, lse = mla_decode_fp8(qn, qp, pool.layer(0), *_idx(batch), SM, pool.scale(0), num_splits=splits,
                              q_fp8=q8, return_lse=True)
    _check(out, lse, ref, ref_lse, TOL_Q8 if q8 else TOL_BF16_OUT, TOL_LSE_Q8 if q8 else TOL_LSE)
    kv16 = deq.to(torch.bfloat16)  # a 16-bit pool holding the same values (e4m3 fits bf16 exactly)
    ref16, lse16 = reference.mla_decode(qn, qp, kv16.double(), batch, SM, return_lse=True)
    out16, l16 = mla_decode(qn, qp, kv16, *_idx(batch), SM, num_splits=splits, return_lse=True)
    _check(out16, l16, ref16, lse16, TOL_BF16_OUT, TOL_LSE)


def test_q8_quantization_matches_its_description():
    """One scale per (request, head block) = amax / 448; the dequantized query is within e4m3."""
    qn, qp = kvpool.make_queries(3, 20, seed=4)
    qn8, qp8, sc = md8.quantize_q_fp8(qn, qp, block_h=16)
    assert sc.shape == (3, 2)
    amax = torch.cat([qn, qp], -1).float().abs().amax(-1)  # [3, 20]
    assert torch.allclose(sc[:, 0], amax[:, :16].amax(-1) / 448) and torch.allclose(sc[:, 1], amax[:, 16:].amax(-1) / 448)
    back = qn8.float() * sc.repeat_interleave(16, 1)[:, :20, None]
    assert reference.rel_err(back, qn.float()) < 2**-4


# ------------------------------------------------------------------ backends --------------------
TRITON_BACKENDS = ["full_pool_cast.triton", "full_pool_cast.seed", "gather_cast.triton", "fp8_native.triton",
                   "fp8_native.triton_q8"]


def test_triton_backends_registered_with_rules_as_data():
    names = backends.names()
    for n in TRITON_BACKENDS + ["bf16_pool.triton"]:
        assert n in names
        b = backends.get(n)
        assert b.runs_on_cpu
        assert b.max_heads == 128 and b.page_sizes == backends.ALL_PAGE_SIZES
    assert backends.get("fp8_native.triton").min_capability == (8, 9)
    assert backends.get("fp8_native.triton").kv_dtypes == ("fp8_e4m3",)
    assert backends.get("bf16_pool.triton").kv_dtypes == ("bf16",)
    # by path: torch first on a CPU (the interpreter costs ms a program), the stated GPU order on a GPU
    assert backends.get("fp8_native", device="cpu").name == "fp8_native.torch"
    assert backends.get("fp8_native", device="cuda").name == "fp8_native.gluon"


@pytest.mark.parametrize("page_size", [1, 64])
def test_triton_backends_match_oracle(page_size):
    pool, _, batch, qn, qp = _case(page_size, _edge_lens(page_size) + [150], 16, 7 + page_size)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM)
    for n in TRITON_BACKENDS:
        if page_size not in backends.get(n).page_sizes:
            continue
        out = backends.get(n).decode(qn, qp, pool, 0, batch, SM)
        assert reference.rel_err(out, ref) < (TOL_Q8 if n.endswith("q8") else TOL_BF16_OUT), n
    # the same values in a BF16 pool (e4m3 values are exact in bf16)
    pool16 = kvpool.KVPool(pool.dequant(0, torch.bfloat16)[None], torch.ones(1))
    assert reference.rel_err(backends.get("bf16_pool.triton").decode(qn, qp, pool16, 0, batch, SM), ref) < TOL_BF16_OUT


def test_bf16_pool_backend_refuses_fp8():
    pool, _, batch, qn, qp = _case(16, [20], 4, 0)
    with pytest.raises(ValueError, match="bf16_pool.triton.*takes KV dtypes"):
        backends.get("bf16_pool.triton").decode(qn, qp, pool, 0, batch, SM)


# ------------------------------------------------------------------ GPU -------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_VARIANTS = {**VARIANTS, "pipe64": dict(q_fp8=False, block_n=64, num_warps=4, num_stages=3)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
@pytest.mark.parametrize("page_size,heads", [(64, 16), (1, 8), (128, 128), (16, 64)])
def test_gpu_mla_decode_fp8(variant, page_size, heads):
    kw = GPU_VARIANTS[variant]
    if kw.get("swap") and heads > 32:
        pytest.skip("swapped tiles are for few heads: 64 heads need more shared memory than an SM has")
    lens = _edge_lens(page_size) + [4097, 1000]
    pool, _, batch, qn, qp = _case(page_size, lens, heads, 5, device="cuda")
    ref, ref_lse = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM, return_lse=True)
    out, lse = mla_decode_fp8(qn, qp, pool.layer(0), *_idx(batch), SM, pool.scale(0), return_lse=True, **kw)
    q8 = kw.get("q_fp8", True)
    _check(out, lse, ref, ref_lse, TOL_GPU_Q8 if q8 else TOL_GPU, 0.2 if q8 else 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_size,heads,splits", [(64, 16, None), (1, 8, 4), (128, 128, 1)])
def test_gpu_mla_decode_16bit_and_casts(page_size, heads, splits):
    lens = _edge_lens(page_size) + [8192, 3000]
    pool, _, batch, qn, qp = _case(page_size, lens, heads, 6, device="cuda")
    kv16 = pool.dequant(0, torch.bfloat16)
    ref, ref_lse = reference.mla_decode(qn, qp, kv16.double(), batch, SM, return_lse=True)
    out, lse = mla_decode(qn, qp, kv16, *_idx(batch), SM, num_splits=splits, return_lse=True)
    _check(out, lse, ref, ref_lse, TOL_GPU, 1e-2)
    assert torch.equal(fp8_to_bf16(pool.layer(0)), pool.layer(0).to(torch.bfloat16))
    assert torch.equal(gather_cast(pool.layer(0), batch.kv_indices),
                       pool.layer(0)[batch.kv_indices.long()].to(torch.bfloat16))


@pytest.mark.parametrize("block_h, block_d", [(None, None), (1, 128), (2, 64)])
def test_merge_against_torch_lse_merge(block_h, block_d):
    """Split partials merged by log-sum-exp, in the CPU layout and in the GPU's finer tiling
    (heads x column blocks): empty splits (lse -inf) hold NaN and must never be read."""
    from labkit.kernels.mla_merge import mla_merge

    g = torch.Generator().manual_seed(11)
    B, H, S, DV = 2, 3, 5, 512
    part = torch.randn(B, H, S, DV, generator=g)
    lse2 = torch.randn(B, H, S, generator=g) * 3
    lse2[0, 1, 2:] = -float("inf")  # a short request: its last splits are empty
    part[0, 1, 2:] = float("nan")
    lse2[1, 2, :] = -float("inf")  # an empty head row
    out, lse = mla_merge(part, lse2, torch.float32, 0.5, block_h=block_h, block_d=block_d)
    w = torch.softmax(lse2.double() * math.log(2), dim=-1).nan_to_num(0.0)  # [B, H, S]
    ref = (w[..., None] * part.double().nan_to_num(0.0)).sum(2) * 0.5
    ref_lse = torch.logsumexp(lse2.double() * math.log(2), dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_merge_reads_bf16_partials():
    """The fast precision's bf16 partials: merged in fp32 from the bf16 values as stored."""
    from labkit.kernels.mla_merge import mla_merge

    g = torch.Generator().manual_seed(12)
    part = torch.randn(3, 4, 6, 512, generator=g).to(torch.bfloat16)
    lse2 = torch.randn(3, 4, 6, generator=g) * 3
    lse2[2, 0, 3:] = -float("inf")
    out, lse = mla_merge(part, lse2, torch.float32, 2.0, block_h=2, block_d=128)
    w = torch.softmax(lse2.double() * math.log(2), dim=-1)
    ref = (w[..., None] * part.double()).sum(2) * 2.0
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(lse2.double() * math.log(2), -1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="part_out must be a contiguous float32 or bfloat16"):
        mla_merge(part.half(), lse2, torch.float32)
