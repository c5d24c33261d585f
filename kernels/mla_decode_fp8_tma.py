"""Paged absorbed-MLA decode over FP8 (e4m3) pages, loaded by TMA into a multi-stage ring.

The same function as ``mla_decode_fp8`` (split-KV, ``mla_merge`` as stage 2, ``k_scale`` folded
into the softmax scale and ``v_scale`` into the output), built for bandwidth at few heads:

* A tile is one page's run of BLOCK_N tokens, so it is a dense [BLOCK_N, 576] box of the pool and
  a tensor-memory-access (TMA) descriptor fetches it: no per-row address math, and Triton's
  pipeliner keeps NUM_STAGES - 1 tiles in flight in a ring of shared-memory buffers while the
  current one is computed (the pointer-gather kernel waits for its single buffer every tile).
* Scores come from an FP8 dot with the tile straight from shared memory (tokens on the MMA's M
  side: s^T = K @ q^T, wgmma), the query quantized to e4m3 in registers, one scale per program.
* Only V (the 512 ckv columns) is widened to fp16, once per tile, in registers (inline PTX
  ``cvt.rn.f16x2.e4m3x2``), then p @ V (PV_SWAP 0, mma.sync with heads on M) or
  out^T = V^T @ p^T (PV_SWAP 1, wgmma with the 512 columns on M).

Needs page_size to be a multiple of BLOCK_N (a tile never straddles pages): page sizes 64 and
128 with BLOCK_N 64. Rows past a request's end inside its last page are read but masked: their
scores are -inf and their V rows are zeroed before the dot (a stale page may hold NaN bytes).
The descriptors are built in the kernel (a host descriptor argument cost ~150 us a launch in
Triton 3.6); the page ids come by inline PTX so that the pipeliner keeps its stages for the tiles.

Moves L*576 B of KV (L = tokens read, whole tiles) + B*H*(576 + 512)*2 B of queries and outputs
(+ B*H*S*513*4 B of split partials, twice); 2*H*L*(576 + 512) FLOPs. H200, 16 heads, 64 x 8K:
144 us = 2.1 TB/s, 49% of copy bandwidth, 1.18x the BF16-pool kernel (docs/perf-notes.md, run 3).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla_decode import (D_CKV, D_KPE, LOG2E, check_decode_args, decode_buffers, pick_block_h,
                         resolve_splits)
from .mla_decode_fp8 import _widen, quantize_q_fp8
from .mla_merge import mla_merge, round_to_bf16

HAS_DEVICE_TMA = hasattr(tl, "make_tensor_descriptor")  # Triton >= 3.4


def _scratch(size: int, alignment: int, stream):
    """Global scratch for descriptors built on the device (Triton asks its allocator for it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton.jit
def _load_page(ptr, CVT: tl.constexpr):
    """The page id of a tile. On the GPU an inline-PTX load: the pipeliner does not see it, so it
    does not spend a pipeline stage (and a ring buffer) on it; the ids are L1-resident after the
    first tile of a request (32 to a cache line)."""
    if CVT == 0:  # interpreter
        return tl.load(ptr)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _store_out(ptrs, out, hmask, CVT: tl.constexpr):
    """Final output rows in the output dtype (rounded to nearest bf16 first in the interpreter,
    whose own fp32 -> bf16 cast truncates)."""
    if CVT == 0:
        if ptrs.dtype.element_ty == tl.bfloat16:
            out = round_to_bf16(out)
    tl.store(ptrs, out.to(ptrs.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _tile(ckv_desc, kpe_desc, kv_indices_ptr, page_base, n0, end, q_n, q_nb, q_p, qk_scale, m_i, l_i, acc, acc_b,
          MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CVT: tl.constexpr,
          PV_SWAP: tl.constexpr, HALVES: tl.constexpr):
    """One tile of BLOCK_N tokens from n0: online-softmax update of (m_i, l_i, acc, acc_b).
    MASKED: tokens >= end get -inf scores and zero V rows (a stale page may hold NaN bytes); only
    a split's last tile can be partial, so the pipelined loop runs unmasked."""
    DH: tl.constexpr = 256
    page = _load_page(kv_indices_ptr + page_base + n0 // PAGE, CVT)
    row = page * PAGE + n0 % PAGE
    nmask = n0 + tl.arange(0, BLOCK_N) < end
    if HALVES == 1:
        k8 = ckv_desc.load([row, 0])  # [BLOCK_N, 512] fp8
        kp8 = kpe_desc.load([row, 0])  # [BLOCK_N, 64] fp8
        s = tl.dot(k8, q_n) + tl.dot(kp8, q_p)  # s^T [BLOCK_N, BLOCK_H], fp8 x fp8 -> fp32
    else:  # two [BLOCK_N, 256] boxes: V is widened and multiplied half by half (fewer live registers)
        k8 = ckv_desc.load([row, 0])
        k8b = ckv_desc.load([row, DH])
        kp8 = kpe_desc.load([row, 0])
        s = tl.dot(k8, q_n) + tl.dot(k8b, q_nb) + tl.dot(kp8, q_p)
    s = s * qk_scale
    if MASKED:
        s = tl.where(nmask[:, None], s, -float("inf"))
    if not PV_SWAP:
        s = tl.trans(s)  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1 - PV_SWAP))  # reduce over the tokens
    alpha = tl.exp2(m_i - m_new)
    if PV_SWAP:
        p = tl.exp2(s - m_new[None, :])  # p^T [BLOCK_N, BLOCK_H]
        acc = acc * alpha[None, :]
    else:
        p = tl.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None]
    l_i = l_i * alpha + tl.sum(p, 1 - PV_SWAP)
    v = _widen(k8, CVT)  # [BLOCK_N, 512 / HALVES]
    if MASKED:
        v = tl.where(nmask[:, None], v, 0.0)
    if PV_SWAP:
        acc = tl.dot(tl.trans(v), p.to(v.dtype), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    if HALVES == 2:
        vb = _widen(k8b, CVT)
        if MASKED:
            vb = tl.where(nmask[:, None], vb, 0.0)
        if PV_SWAP:
            acc_b = tl.dot(tl.trans(vb), p.to(vb.dtype), acc_b * alpha[None, :])
        else:
            acc_b = tl.dot(p.to(vb.dtype), vb, acc_b * alpha[:, None])
    return m_new, l_i, acc, acc_b


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_decode_fp8_tma_kernel(
    q_nope_ptr,  # *[B, H, 512] bf16/fp16 (fp8 when Q_FP8 == 1); last dim contiguous
    q_pe_ptr,  # *[B, H, 64]
    kv_ptr,  # *fp8e4nv [num_pages, PAGE, 576], dense: seen as num_rows token rows of 576 bytes
    num_rows,  # num_pages * PAGE
    kv_indptr_ptr,  # *i32 [B + 1]
    kv_indices_ptr,  # *i32 [nnz] page ids
    kv_lens_ptr,  # *i32 [B]
    o_ptr,  # *f32 [B, H, S, 512] partials, or *out dtype [B, H, 512] when DIRECT
    lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
    q_scale_ptr,  # *f32 [B, head blocks] scales of an FP8 query (Q_FP8 == 1)
    qk_scale,  # sm_scale * k_scale * log2(e)
    out_scale,  # v_scale; DIRECT only
    H,
    num_splits,  # S
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_o_b, stride_o_h,
    PAGE: tl.constexpr,  # page_size, a multiple of BLOCK_N
    BLOCK_N: tl.constexpr,  # tokens per tile
    BLOCK_H: tl.constexpr,  # heads per program (>= 16)
    DIRECT: tl.constexpr,  # one split: write the final output and natural-log lse
    CVT: tl.constexpr,  # how V is widened: 0 f32 (interpreter) | 2 inline-PTX fp16
    Q_FP8: tl.constexpr,  # 1: q given in FP8 with q_scale_ptr (CPU) | 2: quantized here (GPU)
    PV_SWAP: tl.constexpr,  # 0: p @ V | 1: out^T = V^T @ p^T
    HALVES: tl.constexpr,  # 1: [BLOCK_N, 512] ckv boxes | 2: two [BLOCK_N, 256] boxes, V by halves
    NUM_STAGES: tl.constexpr,  # shared-memory ring depth of the tile loads
):
    DC: tl.constexpr = 512
    DP: tl.constexpr = 64
    DV: tl.constexpr = DC // HALVES  # columns of V per accumulator
    DH: tl.constexpr = 256  # second half's first column (HALVES == 2)
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    hmask = heads < H
    dv = tl.arange(0, DV)
    dp = tl.arange(0, DP)

    # TMA descriptors built here (a plain pointer launches faster than a host descriptor):
    # ckv columns 0..511 in [BLOCK_N, 512 / HALVES] boxes, kpe columns 512..575 in [BLOCK_N, 64]
    ckv_desc = tl.make_tensor_descriptor(kv_ptr, shape=[num_rows, DC], strides=[DC + DP, 1],
                                         block_shape=[BLOCK_N, DV])
    kpe_desc = tl.make_tensor_descriptor(kv_ptr + DC, shape=[num_rows, DP], strides=[DC + DP, 1],
                                         block_shape=[BLOCK_N, DP])
    seq_len = tl.load(kv_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # q^T: [512 / HALVES, BLOCK_H] (x HALVES), [64, BLOCK_H]: the B operands of s^T = K @ q^T
    q_n = tl.load(q_nope_ptr + b * stride_qn_b + heads[None, :] * stride_qn_h + dv[:, None],
                  mask=hmask[None, :], other=0.0)
    q_nb = tl.load(q_nope_ptr + b * stride_qn_b + heads[None, :] * stride_qn_h + (DH + dv)[:, None],
                   mask=hmask[None, :] & (HALVES == 2), other=0.0)
    q_p = tl.load(q_pe_ptr + b * stride_qp_b + heads[None, :] * stride_qp_h + dp[:, None],
                  mask=hmask[None, :], other=0.0)
    if Q_FP8 == 1:
        qk_scale = qk_scale * tl.load(q_scale_ptr + b * tl.num_programs(1) + hblk)
    else:  # this program's q tile in e4m3 with its own scale (amax / 448)
        amax = tl.maximum(tl.max(tl.abs(q_n.to(tl.float32))), tl.max(tl.abs(q_p.to(tl.float32))))
        amax = tl.maximum(amax, tl.max(tl.abs(q_nb.to(tl.float32))))
        q_sc = tl.maximum(amax, 1e-12) / 448.0
        q_n = (q_n.to(tl.float32) / q_sc).to(tl.float8e4nv)
        q_nb = (q_nb.to(tl.float32) / q_sc).to(tl.float8e4nv)
        q_p = (q_p.to(tl.float32) / q_sc).to(tl.float8e4nv)
        qk_scale = qk_scale * q_sc

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PV_SWAP:  # out^T, one accumulator per column block of V
        acc = tl.zeros([DV, BLOCK_H], dtype=tl.float32)
        acc_b = tl.zeros([DV, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    # whole tiles in the pipelined loop; the split's partial last tile (if any) once, masked
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_i, acc, acc_b = _tile(ckv_desc, kpe_desc, kv_indices_ptr, page_base, n0, end, q_n, q_nb, q_p,
                                     qk_scale, m_i, l_i, acc, acc_b, False, PAGE, BLOCK_N, CVT, PV_SWAP, HALVES)
    if full_end < end:
        m_i, l_i, acc, acc_b = _tile(ckv_desc, kpe_desc, kv_indices_ptr, page_base, full_end, end, q_n, q_nb, q_p,
                                     qk_scale, m_i, l_i, acc, acc_b, True, PAGE, BLOCK_N, CVT, PV_SWAP, HALVES)

    l_safe = tl.maximum(l_i, 1e-30)
    inv = tl.where(l_i > 0, 1.0 / l_safe, 0.0)
    if PV_SWAP:
        acc = tl.trans(acc)
        acc_b = tl.trans(acc_b)
    if DIRECT:
        o_rows = o_ptr + b * stride_o_b + heads[:, None] * stride_o_h
        _store_out(o_rows + dv[None, :], acc * (inv * out_scale)[:, None], hmask, CVT)
        if HALVES == 2:  # each half to its own columns (no join of the two accumulators)
            _store_out(o_rows + (DH + dv)[None, :], acc_b * (inv * out_scale)[:, None], hmask, CVT)
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        tl.store(lse_ptr + b * H + heads, lse, mask=hmask)
    else:
        row_o = (b * H + heads) * num_splits + split
        tl.store(o_ptr + row_o[:, None] * DC + dv[None, :], acc * inv[:, None], mask=hmask[:, None])
        if HALVES == 2:
            tl.store(o_ptr + row_o[:, None] * DC + (DH + dv)[None, :], acc_b * inv[:, None], mask=hmask[:, None])
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf"))
        tl.store(lse_ptr + row_o, lse2, mask=hmask)


# Measured on the H200 (scripts/gpu_tma.py, docs/perf-notes.md run 3): two CTAs per SM, each with a
# two-stage ring (85 KB of shared memory), V by halves, p @ V with heads on M, beat one CTA with a
# deeper ring (3 or 4 stages) at every shape tried.
GPU_CONFIG = dict(block_n=64, num_warps=4, num_stages=2, pv_swap=0, halves=2, ctas_per_sm=2)
MAX_HEADS = 32  # tuned and measured up to 32 heads; more (BLOCK_H 64) spills registers


def mla_decode_fp8_tma(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                       kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                       v_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False, *,
                       block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, pv_swap: int | None = None, halves: int | None = None,
                       ctas_per_sm: int | None = None, max_len: int | None = None):
    """Paged absorbed-MLA decode over an FP8 e4m3 pool, TMA-fed; FP8 query for the scores.

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_buffer : [num_pages, page_size, 576] float8_e4m3fn with dense pages (stride(0) =
        page_size * 576), real = stored * k_scale; page_size a multiple of ``block_n`` (64, 128).
    kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 page ids; kv_lens : [B] int32.
    sm_scale : softmax scale. k_scale : per-tensor scale of the pool, folded into the scores.
    v_scale : scale of V, folded into the output; defaults to k_scale.
    num_splits : splits per request (None: one wave of ``ctas_per_sm`` CTAs per SM).
    return_lse : also return lse.
    block_n, block_h, num_warps, num_stages, pv_swap, halves, ctas_per_sm, max_len : tuning
        (``GPU_CONFIG``); ctas_per_sm sets the default split count (one wave);
        num_stages is the depth of the shared-memory ring (num_stages - 1 tiles in flight).

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32 (natural log).

    Cost: reads L*576 B of KV (L = sum kv_lens, rounded up to whole tiles per split) + queries;
    2*H*L*(576+512) FLOPs; with S > 1 splits, B*H*S*513*4 B of partials for ``mla_merge``.
    Error: the FP8 query gives ~6e-3 relative error against the exact result (as ``mla_decode_fp8``).
    """
    B, H, page_size = check_decode_args("mla_decode_fp8_tma", q_nope, q_pe, kv_buffer, kv_indptr, kv_indices,
                                        kv_lens, kv_dtypes=(torch.float8_e4m3fn,))
    if not HAS_DEVICE_TMA:
        raise ValueError(f"mla_decode_fp8_tma: Triton {triton.__version__} cannot build TMA descriptors in a "
                         f"kernel (tl.make_tensor_descriptor, Triton >= 3.4)")
    dev = q_nope.device
    on_gpu = dev.type == "cuda"
    cfg = dict(GPU_CONFIG)
    given = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, pv_swap=pv_swap, halves=halves,
                 ctas_per_sm=ctas_per_sm)
    cfg.update({k: v for k, v in given.items() if v is not None})
    block_n = cfg["block_n"]
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"mla_decode_fp8_tma: block_n={block_n}: must be a power of two >= 16")
    if page_size % block_n:
        raise ValueError(f"mla_decode_fp8_tma: page_size={page_size} is not a multiple of block_n={block_n}; "
                         f"allowed page sizes {[p for p in (16, 32, 64, 128) if p % block_n == 0]} "
                         f"(use mla_decode_fp8 for smaller pages)")
    if kv_buffer.stride(0) != page_size * (D_CKV + D_KPE):
        raise ValueError(f"mla_decode_fp8_tma: kv_buffer pages must be dense (stride(0) = page_size * 576), "
                         f"got strides {tuple(kv_buffer.stride())}")
    if cfg["pv_swap"] not in (0, 1):
        raise ValueError(f"mla_decode_fp8_tma: pv_swap={cfg['pv_swap']!r}; allowed 0, 1")
    if cfg["halves"] not in (1, 2):
        raise ValueError(f"mla_decode_fp8_tma: halves={cfg['halves']!r}; allowed 1, 2")
    if cfg["pv_swap"] == 1 and cfg["halves"] == 2:  # Triton 3.6 on the H200: wrong outputs at 16 heads
        raise ValueError("mla_decode_fp8_tma: pv_swap=1 with halves=2 is refused: it computed wrong outputs on "
                         "the H200 (Triton 3.6, 16 heads); use halves=1 or pv_swap=0")
    if H > MAX_HEADS:
        raise ValueError(f"mla_decode_fp8_tma: {H} heads; allowed 1..{MAX_HEADS} (use mla_decode_fp8 for more)")
    if v_scale is None:
        v_scale = k_scale
    block_h = pick_block_h(H, block_h)
    head_blocks = triton.cdiv(H, block_h)
    num_splits = resolve_splits("mla_decode_fp8_tma", num_splits, B, head_blocks, kv_lens, max_len, block_n, dev,
                                cfg["ctas_per_sm"])

    qk_scale = float(sm_scale) * float(k_scale) * LOG2E
    if on_gpu:
        qn, qp, q_scale, q_mode = q_nope, q_pe, None, 2
    else:  # the interpreter's f32 -> fp8 casts are wrong: torch quantizes, same scales
        (qn, qp, q_scale), q_mode = quantize_q_fp8(q_nope, q_pe, block_h), 1

    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev)
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    if on_gpu:
        triton.set_allocator(_scratch)  # the kernel's descriptors live in Triton-allocated scratch
    _mla_decode_fp8_tma_kernel[(B, head_blocks, num_splits)](
        qn, qp, kv_buffer, kv_buffer.shape[0] * page_size, kv_indptr, kv_indices, kv_lens, o_buf, lse_buf,
        q_scale if q_scale is not None else lse_buf, qk_scale, float(v_scale), H, num_splits,
        qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, BLOCK_N=block_n, BLOCK_H=block_h, DIRECT=direct, CVT=2 if on_gpu else 0,
        Q_FP8=q_mode, PV_SWAP=int(cfg["pv_swap"]), HALVES=int(cfg["halves"]), NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, float(v_scale))
    return (out, lse) if return_lse else out
