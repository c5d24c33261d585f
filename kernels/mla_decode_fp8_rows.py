"""Absorbed-MLA decode reading FP8 token rows by id: dense (page table) or sparse (DSA top-k slots).

One split-KV kernel for both batch kinds and both FP8 row layouts (``labkit.kvlayout``):

    fp8_per_tensor  row = 576 e4m3 (512 NoPE | 64 RoPE); one k_scale, folded into sm_scale and the output
    fp8_ds_mla      row = 656 B: 512 e4m3 | 4 fp32 group scales | 64 bf16 RoPE

A token is a row of ``kv_rows`` ([pool_tokens, row], ``KVPool.rows(layer)``). Dense: position n of
request b is row ``kv_indices[kv_indptr[b] + n // page_size] * page_size + n % page_size``, for
n < kv_lens[b]. Sparse: position n is row ``token_indices[b, n]``; -1 is masked and never read.

Grid (B, cdiv(H, BLOCK_H), splits); heads sit on the MMA's M side. The 512 NoPE columns are four
groups of 128, each its own score dot and its own P.V. ds_mla group scales, two ways (``ds_scales``):
  "widen" (DS_W, the default): each [BLOCK_N, 128] e4m3 group tile is widened to bf16 with its
           per-token scale multiplied in (exact: a power of two times 3 mantissa bits, bf16 has
           fp32's exponent range); the same tiles serve QK (one chain of bf16 dots against a bf16
           query, RoPE included, no query scale) and P.V (p in bf16). Nothing is scaled per group
           after the dots and no scale vector enters an MMA layout.
  "groups": each group's scale multiplies that group's partial score (per token, as a chain of
           power-of-two ratios so the FP8 dots accumulate into one tile) and that group's p before
           P.V (as a ratio to the tile's largest scale, which multiplies the dot's result), so no KV
           value is scaled and, with PV 0, none is widened.

Query: e4m3 with one scale per (request, head), amax / 448, quantized by ``_quantize_q_kernel``
(Q_PRE, the default) or by each program.
Precision (constexpr):
  Q_SPLIT  0: q = hi (e4m3).  1: q = hi + lo / 16, both e4m3 (two FP8 dots per group; exact to
           ~2^-8, as good as a 16-bit query)
  PV       0: p * 256 (out of e4m3 subnormals) in e4m3, FP8 dot with V as stored.
           1: V widened to fp16 in registers (cvt.rn.f16x2.e4m3x2), p * 256 in fp16, fp16 dot
  P_SPLIT  (PV 0) 1: p = hi + lo / 16, both e4m3: two FP8 dots per group
  EMU      the CPU interpreter: its f32 -> fp8 casts are wrong (not rounded), so values are first
           rounded to e4m3 with integer/fp32 ops (then the cast is exact); fp8 dots are exact there,
           16-bit ones are not, so PV 1 runs in fp32 there
"fast" = Q_SPLIT 0 (PV 0: P_SPLIT 0); "accurate" = Q_SPLIT 1 and PV 1, or PV 0 with P_SPLIT 1.
DS_W: the query is bf16 (one term: the e4m3 query's error is gone, so "fast" is as good as a 16-bit
query) and p is bf16; "accurate" splits p into bf16 hi + lo (two P.V dots per group): on the CPU
p's 8 bits set the error (bf16 q: 2.0-2.2e-3 with one term, 1.7e-3 split, the bf16 output's floor;
fp16 q: 1.5e-3 and 2.1e-4); splitting the query too (bf16 hi + lo) changed nothing for bf16 or
fp16 queries, so the query is one bf16 term there (Q_SPLIT is 0).
On the H200 PV 1 is the default for both (``gpu_config``): the FP8 P.V was 1.7-2.1x slower, since an
FP8 wgmma reads V K-major and Triton transposes the FP8 tile through shared memory for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher
from .mla_decode import LOG2E, decode_buffers, pick_block_h, resolve_splits
from .mla_decode_fp8 import _widen
from .mla_merge import mla_merge, round_to_bf16

LAYOUT_ROW = {"fp8_per_tensor": 576, "fp8_ds_mla": 656}  # bytes per token row
# A 656-byte fp8_ds_mla row (labkit.kvlayout writes it): 512 e4m3 NoPE at byte 0, 4 fp32 group scales
# at DS_SCALE_AT, 64 bf16 RoPE at DS_ROPE_AT. The kernels read a row through three views of the
# same bytes; the constexprs give the row's length and each part's start in those views' elements.
DS_SCALE_AT, DS_ROPE_AT = 512, 528
DS_ROW = tl.constexpr(LAYOUT_ROW["fp8_ds_mla"])  # e4m3 view
DS_ROW_F32, DS_SCALE_AT_F32 = tl.constexpr(LAYOUT_ROW["fp8_ds_mla"] // 4), tl.constexpr(DS_SCALE_AT // 4)
DS_ROW_BF16, DS_ROPE_AT_BF16 = tl.constexpr(LAYOUT_ROW["fp8_ds_mla"] // 2), tl.constexpr(DS_ROPE_AT // 2)
PRECISIONS = ("fast", "accurate")
PV_MODES = {"fp8": 0, "f16": 1}
DS_SCALES = ("widen", "groups")  # fp8_ds_mla: scales into K/V as widened to bf16, or per-group scores and p
P_SCALE = 256.0  # p in [0, 1] -> p * 256: e4m3 normal down to p = 2^-14


@triton.jit
def _round_e4m3(x):
    """fp32 -> the e4m3 value nearest to x (ties to even), saturating at +-448, as fp32: bit
    arithmetic on the fp32 word (normals keep 3 mantissa bits; below 2^-6 steps of 2^-9)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # 1.5 * 2^23: rounds to an integer
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _e4m3(x, EMU: tl.constexpr):
    """fp32 -> float8e4nv, nearest-even, saturating at +-448."""
    if EMU:  # the interpreter's cast does not round: round first, the cast is then exact
        return _round_e4m3(x).to(tl.float8e4nv)
    return tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def _split_e4m3(x, EMU: tl.constexpr):
    """x ~= hi + lo / 16, both e4m3 (lo = 16 * residual: normal down to residuals of 2^-10). The
    residual is taken from hi's value rounded in fp32 (``_round_e4m3``), not from the fp8 tile
    converted back: with the read-back the H200 (Triton 3.6) gave 0.13-0.7 relative error where the
    interpreter gave 1.8e-3 (data/kernels/h200_rows_1); a 64 x 64 read-back alone was exact there."""
    hi32 = _round_e4m3(x)
    return hi32.to(tl.float8e4nv), _e4m3((x - hi32) * 16.0, EMU)


@triton.jit
def _q_amax(q_ptr, row_off, hmask, col0, W: tl.constexpr):
    """Per-head max |q| over columns col0 .. col0 + W: [BLOCK_H] fp32."""
    x = tl.load(q_ptr + row_off[:, None] + col0 + tl.arange(0, W)[None, :], mask=hmask[:, None], other=0.0)
    return tl.max(tl.abs(x.to(tl.float32)), 1)


@triton.jit
def _q_fp8(q_ptr, row_off, hmask, col0, inv, W: tl.constexpr, Q_SPLIT: tl.constexpr, EMU: tl.constexpr):
    """Columns col0 .. col0 + W of q times inv (per head) as e4m3 hi and lo (lo = 16 * residual)."""
    x = tl.load(q_ptr + row_off[:, None] + col0 + tl.arange(0, W)[None, :], mask=hmask[:, None], other=0.0)
    x = x.to(tl.float32) * inv[:, None]
    if Q_SPLIT:
        hi, lo = _split_e4m3(x, EMU)
    else:
        hi = _e4m3(x, EMU)
        lo = hi
    return hi, lo


@triton.jit
def _q_scale(q_nope_ptr, q_pe_ptr, qn_off, qp_off, hmask, DS: tl.constexpr):
    """Per-head e4m3 scale amax / 448 (ds_mla: of the NoPE part only) and its inverse: [BLOCK_H] each."""
    a01 = tl.maximum(_q_amax(q_nope_ptr, qn_off, hmask, 0, 128), _q_amax(q_nope_ptr, qn_off, hmask, 128, 128))
    a23 = tl.maximum(_q_amax(q_nope_ptr, qn_off, hmask, 256, 128), _q_amax(q_nope_ptr, qn_off, hmask, 384, 128))
    amax = tl.maximum(a01, a23)
    if not DS:
        amax = tl.maximum(amax, _q_amax(q_pe_ptr, qp_off, hmask, 0, 64))
    q_sc = tl.maximum(amax, 1e-30) / 448.0
    return q_sc, 1.0 / q_sc


@triton.jit
def _q_load8(q8_ptr, row_off, hmask, col0, W: tl.constexpr, Q_SPLIT: tl.constexpr):
    """Columns col0 .. col0 + W of a pre-quantized query: hi and lo, [BLOCK_H, W] e4m3 each."""
    offs = row_off[:, None] + col0 + tl.arange(0, W)[None, :]
    hi = tl.load(q8_ptr + offs, mask=hmask[:, None], other=0.0)
    lo = hi
    if Q_SPLIT:
        lo = tl.load(q8_ptr + offs + 576, mask=hmask[:, None], other=0.0)
    return hi, lo


@triton.jit(do_not_specialize=["H"])
def _quantize_q_kernel(q_nope_ptr, q_pe_ptr, q8_ptr, qsc_ptr, H, stride_qn_b, stride_qn_h, stride_qp_b,
                       stride_qp_h, DS: tl.constexpr, Q_SPLIT: tl.constexpr, EMU: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """q -> q8 [B, H, 2, 576] e4m3 (hi | lo: lo = 16 * residual) and qsc [B, H] fp32; grid (B, head blocks)."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    qn_off = b * stride_qn_b + heads * stride_qn_h
    qp_off = b * stride_qp_b + heads * stride_qp_h
    q_sc, inv = _q_scale(q_nope_ptr, q_pe_ptr, qn_off, qp_off, hmask, DS)
    tl.store(qsc_ptr + b * H + heads, q_sc, mask=hmask)
    out = (b * H + heads)[:, None] * 1152
    for g in tl.static_range(4):
        hi, lo = _q_fp8(q_nope_ptr, qn_off, hmask, g * 128, inv, 128, Q_SPLIT, EMU)
        cols = g * 128 + tl.arange(0, 128)[None, :]
        tl.store(q8_ptr + out + cols, hi, mask=hmask[:, None])
        tl.store(q8_ptr + out + 576 + cols, lo, mask=hmask[:, None])
    hi, lo = _q_fp8(q_pe_ptr, qp_off, hmask, 0, inv, 64, Q_SPLIT, EMU)
    cols = 512 + tl.arange(0, 64)[None, :]
    tl.store(q8_ptr + out + cols, hi, mask=hmask[:, None])
    tl.store(q8_ptr + out + 576 + cols, lo, mask=hmask[:, None])


@triton.jit
def _qk(hi, lo, k, acc, Q_SPLIT: tl.constexpr):
    """acc + q . k^T: [BLOCK_H, W] e4m3 query terms, [BLOCK_N, W] e4m3 keys, acc [BLOCK_H, BLOCK_N] fp32.
    Chained as accumulating dots (lo first, at 16x), so no second accumulator is live."""
    kt = tl.trans(k)
    if Q_SPLIT:
        acc = tl.dot(lo, kt, acc * 16.0) * 0.0625
    return tl.dot(hi, kt, acc)


@triton.jit
def _pv(x, v, acc, PV: tl.constexpr, P_SPLIT: tl.constexpr, EMU: tl.constexpr):
    """acc + x @ v: x [BLOCK_H, BLOCK_N] fp32 in [0, 256] (scaled p), v [BLOCK_N, 128] e4m3."""
    if PV == 0:
        if P_SPLIT:
            hi, lo = _split_e4m3(x, EMU)
            acc = tl.dot(lo, v, acc * 16.0) * 0.0625
        else:
            hi = _e4m3(x, EMU)
        acc = tl.dot(hi, v, acc)
    elif EMU:
        acc = tl.dot(x, v.to(tl.float32), acc)
    else:
        acc = tl.dot(x.to(tl.float16), _widen(v, False), acc)
    return acc


@triton.jit
def _q_bf16(q_ptr, row_off, hmask, col0, W: tl.constexpr, EMU: tl.constexpr):
    """Columns col0 .. col0 + W of q rounded to bf16: [BLOCK_H, W] (fp32 holding bf16 values under
    EMU). The rounding is bit arithmetic in fp32 (``round_to_bf16``): the interpreter's casts truncate."""
    x = tl.load(q_ptr + row_off[:, None] + col0 + tl.arange(0, W)[None, :], mask=hmask[:, None], other=0.0)
    hi = round_to_bf16(x.to(tl.float32))
    if not EMU:
        hi = hi.to(tl.bfloat16)
    return hi


@triton.jit
def _widen_scaled(k, sc, EMU: tl.constexpr):
    """[BLOCK_N, 128] e4m3 times each row's power-of-two group scale sc [BLOCK_N] fp32 -> bf16: exact
    (3 mantissa bits times a power of two; bf16 has fp32's exponent range). fp32 under EMU."""
    x = k.to(tl.float32) * sc[:, None]
    if EMU:
        return x
    return x.to(tl.bfloat16)


@triton.jit
def _qk16(q, k, acc):
    """acc + q . k^T: [BLOCK_H, W] bf16 query, [BLOCK_N, W] bf16 keys, acc [BLOCK_H, BLOCK_N] fp32."""
    return tl.dot(q, tl.trans(k), acc)


@triton.jit
def _pv16(x, v, acc, P_SPLIT: tl.constexpr, EMU: tl.constexpr):
    """acc + x @ v: x [BLOCK_H, BLOCK_N] fp32 (scaled p) in bf16 (P_SPLIT: hi + lo terms), v [BLOCK_N,
    128] bf16 (fp32 under EMU)."""
    hi = round_to_bf16(x)
    if P_SPLIT:
        lo = round_to_bf16(x - hi)
        if EMU:
            acc = tl.dot(lo, v, acc)
        else:
            acc = tl.dot(lo.to(tl.bfloat16), v, acc)
    if EMU:
        return tl.dot(hi, v, acc)
    return tl.dot(hi.to(tl.bfloat16), v, acc)


@triton.jit
def _tile_rows(kv_indices_ptr, tok_ptr, page_base, n0, end, SPARSE: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Rows (int64) of positions n0 .. n0 + BLOCK_N of a request and which are to be read."""
    offs = n0 + tl.arange(0, BLOCK_N)
    inr = offs < end
    if SPARSE:
        t = tl.load(tok_ptr + offs, mask=inr, other=-1)
        nmask = t >= 0
        rows = tl.where(nmask, t, 0).to(tl.int64)
    else:
        nmask = inr
        if PAGE >= BLOCK_N:  # the tile lies in one page
            page = tl.load(kv_indices_ptr + page_base + n0 // PAGE).to(tl.int64)
        else:
            page = tl.load(kv_indices_ptr + page_base + offs // PAGE, mask=inr, other=0).to(tl.int64)
        rows = page * PAGE + offs % PAGE
    return rows, nmask


@triton.jit
def _store_group(o_ptr, acc, hmask, o_row, col0, scale, DIRECT: tl.constexpr, EMU: tl.constexpr):
    """Columns col0 .. col0 + 128 of the output (DIRECT) or of this split's partial row."""
    out = acc * scale[:, None]
    cols = col0 + tl.arange(0, 128)
    if DIRECT:
        if EMU:  # the interpreter truncates fp32 -> bf16: round first
            if o_ptr.dtype.element_ty == tl.bfloat16:
                out = round_to_bf16(out)
        tl.store(o_ptr + o_row[:, None] + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        tl.store(o_ptr + o_row[:, None] * 512 + cols[None, :], out, mask=hmask[:, None])


@triton.jit(do_not_specialize=["H", "num_splits", "topk"])
def _mla_decode_fp8_rows_kernel(
    q_nope_ptr,  # *[B, H, 512] bf16/fp16, last dim contiguous
    q_pe_ptr,  # *[B, H, 64]
    kv8_ptr,  # *fp8e4nv [pool_tokens, ROW] the rows as bytes
    kvs_ptr,  # *fp32 [pool_tokens, ROW / 4] the same rows (ds_mla group scales at word 128)
    kvr_ptr,  # *bf16 [pool_tokens, ROW / 2] the same rows (ds_mla RoPE at element DS_ROPE_AT_BF16)
    kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr,  # dense: *i32 [B + 1], [nnz], [B]
    tok_ptr,  # sparse: *i32 [B, topk] rows, -1 masked
    q8_ptr,  # Q_PRE: *fp8e4nv [B, H, 2, 576] the query's hi | lo terms
    qsc_ptr,  # Q_PRE: *f32 [B, H] their scales
    o_ptr,  # *f32 [B, H, S, 512] partials, or *q dtype [B, H, 512] when DIRECT
    lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
    qk_scale,  # sm_scale * k_scale * log2(e)
    out_scale,  # k_scale / 256 (PV scale), DIRECT only
    H, num_splits,
    topk,  # sparse: positions per request (token_indices is [B, topk], contiguous)
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_o_b, stride_o_h,
    ROW: tl.constexpr,  # 576 or 656
    DS: tl.constexpr,  # fp8_ds_mla rows
    DS_W: tl.constexpr,  # ds_mla: group scales multiplied into K/V as they are widened to bf16
    SPARSE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DIRECT: tl.constexpr,
    Q_SPLIT: tl.constexpr, PV: tl.constexpr, P_SPLIT: tl.constexpr, EMU: tl.constexpr,
    Q_PRE: tl.constexpr,  # the query quantized by a separate launch (fewer registers in this one)
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    split = tl.program_id(2)
    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    if SPARSE:
        seq_len = topk
        page_base = 0
        tok_ptr += b.to(tl.int64) * topk
    else:
        seq_len = tl.load(kv_lens_ptr + b)
        page_base = tl.load(kv_indptr_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # the query in e4m3, one scale per head (ds_mla: RoPE stays 16-bit, outside the scale)
    qn_off = b * stride_qn_b + heads * stride_qn_h
    qp_off = b * stride_qp_b + heads * stride_qp_h
    if DS_W:  # bf16 query, no scale: the keys are widened to bf16 with theirs
        qh0 = _q_bf16(q_nope_ptr, qn_off, hmask, 0, 128, EMU)
        qh1 = _q_bf16(q_nope_ptr, qn_off, hmask, 128, 128, EMU)
        qh2 = _q_bf16(q_nope_ptr, qn_off, hmask, 256, 128, EMU)
        qh3 = _q_bf16(q_nope_ptr, qn_off, hmask, 384, 128, EMU)
        qph = _q_bf16(q_pe_ptr, qp_off, hmask, 0, 64, EMU)
    elif Q_PRE:  # quantized by _quantize_q_kernel: [B, H, 2, 576] e4m3 (hi | lo) and [B, H] scales
        q8_off = (b * H + heads) * 1152
        q_sc = tl.load(qsc_ptr + b * H + heads, mask=hmask, other=1.0)
        qh0, ql0 = _q_load8(q8_ptr, q8_off, hmask, 0, 128, Q_SPLIT)
        qh1, ql1 = _q_load8(q8_ptr, q8_off, hmask, 128, 128, Q_SPLIT)
        qh2, ql2 = _q_load8(q8_ptr, q8_off, hmask, 256, 128, Q_SPLIT)
        qh3, ql3 = _q_load8(q8_ptr, q8_off, hmask, 384, 128, Q_SPLIT)
        qph, qpl = _q_load8(q8_ptr, q8_off, hmask, 512, 64, Q_SPLIT)
    else:
        q_sc, inv = _q_scale(q_nope_ptr, q_pe_ptr, qn_off, qp_off, hmask, DS)
        qh0, ql0 = _q_fp8(q_nope_ptr, qn_off, hmask, 0, inv, 128, Q_SPLIT, EMU)
        qh1, ql1 = _q_fp8(q_nope_ptr, qn_off, hmask, 128, inv, 128, Q_SPLIT, EMU)
        qh2, ql2 = _q_fp8(q_nope_ptr, qn_off, hmask, 256, inv, 128, Q_SPLIT, EMU)
        qh3, ql3 = _q_fp8(q_nope_ptr, qn_off, hmask, 384, inv, 128, Q_SPLIT, EMU)
        qph, qpl = _q_fp8(q_pe_ptr, qp_off, hmask, 0, inv, 64, Q_SPLIT, EMU)  # unused for ds_mla
    if DS and not DS_W:
        q_r = tl.load(q_pe_ptr + qp_off[:, None] + d64[None, :], mask=hmask[:, None], other=0.0)
        if EMU:
            q_r = q_r.to(tl.float32)
        else:
            q_r = q_r.to(tl.bfloat16)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        rows, nmask = _tile_rows(kv_indices_ptr, tok_ptr, page_base, n0, end, SPARSE, PAGE, BLOCK_N)
        base = kv8_ptr + rows[:, None] * ROW + d128[None, :]
        k0 = tl.load(base, mask=nmask[:, None], other=0.0)  # [BLOCK_N, 128] e4m3 each
        k1 = tl.load(base + 128, mask=nmask[:, None], other=0.0)
        k2 = tl.load(base + 256, mask=nmask[:, None], other=0.0)
        k3 = tl.load(base + 384, mask=nmask[:, None], other=0.0)
        if DS_W:  # one chain of bf16 dots over the scaled tiles; the same tiles serve P.V below
            sw = kvs_ptr + rows * (ROW // 4) + DS_SCALE_AT_F32
            w0 = _widen_scaled(k0, tl.load(sw, mask=nmask, other=0.0), EMU)
            w1 = _widen_scaled(k1, tl.load(sw + 1, mask=nmask, other=0.0), EMU)
            w2 = _widen_scaled(k2, tl.load(sw + 2, mask=nmask, other=0.0), EMU)
            w3 = _widen_scaled(k3, tl.load(sw + 3, mask=nmask, other=0.0), EMU)
            kr = tl.load(kvr_ptr + rows[:, None] * (ROW // 2) + DS_ROPE_AT_BF16 + d64[None, :], mask=nmask[:, None],
                         other=0.0)
            if EMU:
                kr = kr.to(tl.float32)
            s = _qk16(qph, kr, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32))
            s = _qk16(qh0, w0, s)
            s = _qk16(qh1, w1, s)
            s = _qk16(qh2, w2, s)
            s = _qk16(qh3, w3, s)
        elif DS:
            sw = kvs_ptr + rows * (ROW // 4) + DS_SCALE_AT_F32
            sc0 = tl.load(sw, mask=nmask, other=0.0)  # [BLOCK_N] fp32, power-of-two group scales
            sc1 = tl.load(sw + 1, mask=nmask, other=0.0)
            sc2 = tl.load(sw + 2, mask=nmask, other=0.0)
            sc3 = tl.load(sw + 3, mask=nmask, other=0.0)
            kr = tl.load(kvr_ptr + rows[:, None] * (ROW // 2) + DS_ROPE_AT_BF16 + d64[None, :], mask=nmask[:, None],
                         other=0.0)
            if EMU:
                kr = kr.to(tl.float32)
            # sum_g sc_g * d_g chained: ((d0 * sc0/sc1 + d1) * sc1/sc2 + d2) * sc2/sc3 + d3) * sc3; the
            # ratios are powers of two (exact); masked tokens take scale 1 here
            u0 = tl.where(nmask, sc0, 1.0)
            u1 = tl.where(nmask, sc1, 1.0)
            u2 = tl.where(nmask, sc2, 1.0)
            u3 = tl.where(nmask, sc3, 1.0)
            s = _qk(qh0, ql0, k0, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), Q_SPLIT) * (u0 / u1)[None, :]
            s = _qk(qh1, ql1, k1, s, Q_SPLIT) * (u1 / u2)[None, :]
            s = _qk(qh2, ql2, k2, s, Q_SPLIT) * (u2 / u3)[None, :]
            s = _qk(qh3, ql3, k3, s, Q_SPLIT) * u3[None, :]
            s = s * q_sc[:, None] + tl.dot(q_r, tl.trans(kr))
        else:
            kp = tl.load(kv8_ptr + rows[:, None] * ROW + 512 + d64[None, :], mask=nmask[:, None], other=0.0)
            s = _qk(qph, qpl, kp, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), Q_SPLIT)
            s = _qk(qh0, ql0, k0, s, Q_SPLIT)
            s = _qk(qh1, ql1, k1, s, Q_SPLIT)
            s = _qk(qh2, ql2, k2, s, Q_SPLIT)
            s = _qk(qh3, ql3, k3, s, Q_SPLIT) * q_sc[:, None]
        s = tl.where(nmask[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a sparse tile may be all -1 slots
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if DS_W:
            x = p * 256.0
            acc0 = _pv16(x, w0, acc0 * alpha[:, None], P_SPLIT, EMU)
            acc1 = _pv16(x, w1, acc1 * alpha[:, None], P_SPLIT, EMU)
            acc2 = _pv16(x, w2, acc2 * alpha[:, None], P_SPLIT, EMU)
            acc3 = _pv16(x, w3, acc3 * alpha[:, None], P_SPLIT, EMU)
        elif DS:  # p times each token's scale / the tile's largest (a power of two, <= 1)
            mx0 = tl.maximum(tl.max(sc0), 1e-30)
            mx1 = tl.maximum(tl.max(sc1), 1e-30)
            mx2 = tl.maximum(tl.max(sc2), 1e-30)
            mx3 = tl.maximum(tl.max(sc3), 1e-30)
            acc0 = _pv(p * (sc0 * (256.0 / mx0))[None, :], k0, acc0 * (alpha / mx0)[:, None], PV, P_SPLIT, EMU) * mx0
            acc1 = _pv(p * (sc1 * (256.0 / mx1))[None, :], k1, acc1 * (alpha / mx1)[:, None], PV, P_SPLIT, EMU) * mx1
            acc2 = _pv(p * (sc2 * (256.0 / mx2))[None, :], k2, acc2 * (alpha / mx2)[:, None], PV, P_SPLIT, EMU) * mx2
            acc3 = _pv(p * (sc3 * (256.0 / mx3))[None, :], k3, acc3 * (alpha / mx3)[:, None], PV, P_SPLIT, EMU) * mx3
        else:
            x = p * 256.0
            acc0 = _pv(x, k0, acc0 * alpha[:, None], PV, P_SPLIT, EMU)
            acc1 = _pv(x, k1, acc1 * alpha[:, None], PV, P_SPLIT, EMU)
            acc2 = _pv(x, k2, acc2 * alpha[:, None], PV, P_SPLIT, EMU)
            acc3 = _pv(x, k3, acc3 * alpha[:, None], PV, P_SPLIT, EMU)

    l_safe = tl.maximum(l_i, 1e-30)
    inv_l = tl.where(l_i > 0, 1.0 / l_safe, 0.0)
    if DIRECT:
        scale = inv_l * out_scale
        o_row = b * stride_o_b + heads * stride_o_h
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        tl.store(lse_ptr + b * H + heads, lse, mask=hmask)
    else:
        scale = inv_l * (1.0 / 256.0)
        o_row = (b * H + heads) * num_splits + split
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf"))
        tl.store(lse_ptr + o_row, lse, mask=hmask)
    _store_group(o_ptr, acc0, hmask, o_row, 0, scale, DIRECT, EMU)
    _store_group(o_ptr, acc1, hmask, o_row, 128, scale, DIRECT, EMU)
    _store_group(o_ptr, acc2, hmask, o_row, 256, scale, DIRECT, EMU)
    _store_group(o_ptr, acc3, hmask, o_row, 384, scale, DIRECT, EMU)


# GPU tuning, measured on the H200 (scripts/gpu_rows.py -> data/kernels/h200_rows_2; docs/perf-notes.md
# "Run 5"): V widened to fp16 for P.V (1.7-2.1x faster than the FP8 P.V); ds_mla rows in 32-token
# tiles (1.4-1.6x faster than 64: fewer spilled per-token scale vectors); 16-head blocks (mma.sync)
# two CTAs per SM (1.3x). The splits fill one wave of ``ctas_per_sm`` CTAs per SM.
GPU_DEFAULTS = dict(pv="f16", q_pre=True, block_n=64, num_stages=2, ctas_per_sm=1)


def gpu_config(kv_layout: str, block_h: int, ds_scales: str = "widen") -> dict:
    """The measured defaults for a layout and head block (see GPU_DEFAULTS). ds_scales "widen" takes
    the per-tensor tile (not yet measured on its own: no scale vectors in MMA layouts to spill)."""
    cfg = dict(GPU_DEFAULTS)
    if kv_layout == "fp8_ds_mla" and ds_scales == "groups":
        cfg["block_n"] = 32
    if block_h <= 16:
        cfg["ctas_per_sm"] = 2
    return cfg


@dataclass(frozen=True)
class RowsConfig:
    """The options of one call resolved (``rows_config``): what a batch's plan launches every layer.

    kernel:   constexprs and launch options of ``_mla_decode_fp8_rows_kernel`` that neither the batch
              nor the split count changes (ROW, DS, DS_W, BLOCK_N, BLOCK_H, Q_SPLIT, PV, P_SPLIT, EMU,
              Q_PRE, num_warps, num_stages)
    quantize: those of ``_quantize_q_kernel``, or None when the kernel reads the 16-bit query itself
    """

    kv_layout: str
    block_h: int
    block_n: int
    ctas_per_sm: float
    kernel: dict
    quantize: dict | None
    q_block: int  # heads per program of the query launch


def check_options(kv_layout: str, precision: str, pv: str | None, ds_scales: str) -> None:
    if kv_layout not in LAYOUT_ROW:
        raise ValueError(f"mla_decode_fp8_rows: kv_layout={kv_layout!r}; allowed {list(LAYOUT_ROW)}")
    if ds_scales not in DS_SCALES:
        raise ValueError(f"mla_decode_fp8_rows: ds_scales={ds_scales!r}; allowed {list(DS_SCALES)}")
    if kv_layout == "fp8_ds_mla" and ds_scales == "widen" and pv is not None:
        raise ValueError(f"mla_decode_fp8_rows: pv={pv!r} with ds_scales='widen' (P.V is bf16 there); "
                         "allowed None, or ds_scales='groups'")
    if precision not in PRECISIONS:
        raise ValueError(f"mla_decode_fp8_rows: precision={precision!r}; allowed {list(PRECISIONS)}")
    if pv is not None and pv not in PV_MODES:
        raise ValueError(f"mla_decode_fp8_rows: pv={pv!r}; allowed {list(PV_MODES)}")


def rows_config(kv_layout: str, precision: str, heads: int, device, *, pv: str | None = None,
                block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, ctas_per_sm: float | None = None, q_pre: bool | None = None,
                ds_scales: str = "widen") -> RowsConfig:
    """``mla_decode_fp8_rows``'s options (its docstring) resolved for ``heads`` heads on ``device``."""
    check_options(kv_layout, precision, pv, ds_scales)
    on_gpu = torch.device(device).type == "cuda"
    ds = kv_layout == "fp8_ds_mla"
    block_h = pick_block_h(heads, block_h)
    if block_h > 64:
        raise ValueError(f"mla_decode_fp8_rows: block_h={block_h}; allowed powers of two 16..64")
    ds_w = ds and ds_scales == "widen"
    cfg = gpu_config(kv_layout, block_h, ds_scales)
    if not on_gpu:
        cfg.update(block_n=64, num_stages=1)
    given = dict(pv=pv, block_n=block_n, num_stages=num_stages, ctas_per_sm=ctas_per_sm, q_pre=q_pre)
    cfg.update({k: v for k, v in given.items() if v is not None})
    bn = cfg["block_n"]
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"mla_decode_fp8_rows: block_n={bn}; allowed powers of two >= 16")
    if num_warps is None:
        num_warps = 8 if block_h >= 64 else 4
    accurate = precision == "accurate"
    pv_mode = PV_MODES[cfg["pv"]]
    q_pre = bool(cfg["q_pre"]) and not ds_w  # ds_w reads the 16-bit query itself
    kernel = dict(ROW=LAYOUT_ROW[kv_layout], DS=ds, DS_W=ds_w, BLOCK_N=bn, BLOCK_H=block_h,
                  Q_SPLIT=accurate and not ds_w, PV=pv_mode, P_SPLIT=accurate and (pv_mode == 0 or ds_w),
                  EMU=not on_gpu, Q_PRE=q_pre, num_warps=num_warps, num_stages=cfg["num_stages"])
    quantize = dict(DS=ds, Q_SPLIT=accurate, EMU=not on_gpu, num_warps=4) if q_pre else None
    return RowsConfig(kv_layout, block_h, bn, cfg["ctas_per_sm"], kernel, quantize, 16 if on_gpu else 64)


def rows_views(kv_rows: torch.Tensor, kv_layout: str) -> tuple:
    """The same bytes as the kernel reads them: (e4m3 rows, fp32 words, bf16 halves); per-tensor rows
    are read as e4m3 only."""
    kv8 = kv_rows.view(torch.float8_e4m3fn)
    if kv_layout != "fp8_ds_mla":
        return kv8, kv8, kv8
    return kv8, kv_rows.view(torch.float32), kv_rows.view(torch.bfloat16)


def grids(cfg: RowsConfig, batch: int, heads: int, num_splits: int) -> tuple[tuple, tuple]:
    """The decode kernel's grid (B, head blocks, splits) and the query launch's (B, its head blocks)."""
    return (batch, triton.cdiv(heads, cfg.block_h), num_splits), (batch, triton.cdiv(heads, cfg.q_block))


def query_launcher(cfg: RowsConfig, grid: tuple) -> Launcher:
    """The query's quantization on ``grid`` (``grids``' second; cfg.quantize not None), called as
    ``k(q_nope, q_pe, q8, qsc, H, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1))``:
    q_nope [B, H, 512], q_pe [B, H, 64] -> q8 [B, H, 2, 576] float8_e4m3fn (hi | lo terms), qsc [B, H]
    float32, preallocated."""
    return Launcher(_quantize_q_kernel, grid, BLOCK_H=cfg.q_block, **cfg.quantize)


def quantize_query(k: Launcher, q_nope, q_pe, q8, qsc) -> None:
    """Launch ``query_launcher``'s kernel."""
    k(q_nope, q_pe, q8, qsc, q_nope.shape[1], q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1))


def rows_launcher(cfg: RowsConfig, grid: tuple, *, sparse: bool, page: int, direct: bool) -> Launcher:
    """The decode kernel on ``grid`` (``grids``' first) with the constexprs of one call site."""
    return Launcher(_mla_decode_fp8_rows_kernel, grid, SPARSE=sparse, PAGE=page, DIRECT=direct, **cfg.kernel)


def launch_rows(k: Launcher, q_nope, q_pe, views: tuple, kv_indptr, kv_indices, kv_lens, tok,
                q8, qsc, o_buf, lse_buf, qk_scale: float, out_scale: float, topk: int) -> None:
    """Launch the decode kernel (``rows_launcher``), no checks (``mla_decode_fp8_rows`` checks; a
    plan checks once).

    views: ``rows_views`` of the layer. Dense: kv_indptr [B + 1], kv_indices [nnz], kv_lens [B] int32,
    page = page_size, topk = 0 (tok: any int32 tensor). Sparse: tok [B, topk] int32 contiguous,
    page = 1 (the page table arguments are not read: any int32 tensor). q8 / qsc: the quantized
    query (cfg.quantize) or any float32 tensor. o_buf / lse_buf: out [B, H, 512] q dtype and lse
    [B, H] float32 (direct) or the partials [B, H, S, 512], [B, H, S] float32.
    qk_scale = sm_scale * k_scale * log2(e); out_scale = k_scale / 256 (read when direct)."""
    kv8, kvs, kvr = views
    k(q_nope, q_pe, kv8, kvs, kvr, kv_indptr, kv_indices, kv_lens, tok, q8, qsc, o_buf, lse_buf,
      qk_scale, out_scale, q_nope.shape[1], k.grid[2], topk,
      q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1))


def check_query(q_nope, q_pe):
    """Raise ValueError naming what is wrong with the query; returns (B, H)."""
    if q_nope.dim() != 3 or q_nope.shape[-1] != 512:
        raise ValueError(f"mla_decode_fp8_rows: q_nope must be [B, H, 512], got {tuple(q_nope.shape)}")
    B, H, _ = q_nope.shape
    if q_pe.shape != (B, H, 64):
        raise ValueError(f"mla_decode_fp8_rows: q_pe must be [{B}, {H}, 64], got {tuple(q_pe.shape)}")
    check_heads(H, q_nope.dtype)
    if q_pe.dtype != q_nope.dtype:
        raise ValueError(f"mla_decode_fp8_rows: q_nope/q_pe dtypes {q_nope.dtype}/{q_pe.dtype}; allowed "
                         "bfloat16 or float16, the same for both")
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla_decode_fp8_rows: q_nope and q_pe need a contiguous last dim")
    if q_pe.device != q_nope.device:
        raise ValueError(f"mla_decode_fp8_rows: q_pe is on {q_pe.device}, q_nope on {q_nope.device}")
    return B, H


def check_heads(H: int, q_dtype) -> None:
    if q_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mla_decode_fp8_rows: query dtype {q_dtype}; allowed bfloat16 or float16")
    if not 1 <= H <= 128:
        raise ValueError(f"mla_decode_fp8_rows: q_nope has {H} heads; allowed 1..128")


def check_rows(kv_rows, kv_layout: str, device) -> None:
    """kv_rows must be ``KVPool.rows(layer)`` of ``kv_layout`` on ``device``: contiguous, 16-byte aligned."""
    row = LAYOUT_ROW[kv_layout]
    want = torch.float8_e4m3fn if kv_layout == "fp8_per_tensor" else torch.uint8
    if kv_rows.dim() != 2 or kv_rows.shape[1] != row or kv_rows.dtype != want:
        raise ValueError(f"mla_decode_fp8_rows: kv_rows must be [pool_tokens, {row}] {want} for "
                         f"kv_layout={kv_layout!r}, got {tuple(kv_rows.shape)} {kv_rows.dtype}")
    if kv_rows.stride() != (row, 1) or kv_rows.storage_offset() % 16:
        raise ValueError(f"mla_decode_fp8_rows: kv_rows must be contiguous rows, 16-byte aligned "
                         f"(strides {tuple(kv_rows.stride())}, offset {kv_rows.storage_offset()})")
    if kv_rows.device != torch.device(device):
        raise ValueError(f"mla_decode_fp8_rows: kv_rows is on {kv_rows.device}, q_nope on {device}")


def check_int32(name, t, shape, device):
    """``t`` as the kernel reads it: an int32 tensor on ``device`` of ``shape`` (None: any), contiguous."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device:
        raise ValueError(f"mla_decode_fp8_rows: {name} must be an int32 tensor on {device}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"mla_decode_fp8_rows: {name} must have shape {shape}, got {tuple(t.shape)}")
    return t.contiguous()


def check_page_size(page_size, kv_rows) -> None:
    if page_size is None or page_size < 1 or page_size > 128 or page_size & (page_size - 1):
        raise ValueError(f"mla_decode_fp8_rows: page_size={page_size}; allowed powers of two 1..128")
    if kv_rows.shape[0] % page_size:
        raise ValueError(f"mla_decode_fp8_rows: kv_rows has {kv_rows.shape[0]} rows, "
                         f"not whole pages of page_size={page_size}")


def mla_decode_fp8_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, *, sm_scale: float,
                        kv_layout: str, k_scale: float = 1.0, precision: str = "fast",
                        kv_indptr: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
                        kv_lens: torch.Tensor | None = None, page_size: int | None = None,
                        token_indices: torch.Tensor | None = None, max_len: int | None = None,
                        num_splits: int | None = None, return_lse: bool = False, pv: str | None = None,
                        block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, ctas_per_sm: float | None = None, q_pre: bool | None = None,
                        ds_scales: str = "widen"):
    """MLA decode over FP8 token rows, dense (page table) or sparse (token slots).

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_rows : ``KVPool.rows(layer)``, contiguous: [pool_tokens, 576] float8_e4m3fn
        (kv_layout "fp8_per_tensor", real = stored * k_scale) or [pool_tokens, 656] uint8
        ("fp8_ds_mla": 512 e4m3 | 4 fp32 group scales | 64 bf16; k_scale must be 1).
    sm_scale : softmax scale. k_scale : per-tensor scale, folded into the scores and the output.
    precision : "fast" (e4m3 query: 2.4-2.9e-2 rel. error measured) or "accurate" (the query as two
        e4m3 terms: 1.7-1.9e-3; <= 3e-3). Both take P.V with V widened to fp16 on the GPU by default;
        ``pv="fp8"``: p in e4m3 (accurate: two e4m3 terms), V as stored. fp8_ds_mla with
        ds_scales="widen": bf16 query and p, K/V widened to bf16 with their scales ("fast" ~2e-3 on
        the CPU; "accurate": p as bf16 hi + lo, ~1.7e-3); pv must stay None there.
    ds_scales : fp8_ds_mla only: "widen" (default) or "groups" (the per-group score and p scaling
        of FP8 dots; see the module docstring). Ignored for fp8_per_tensor.
    Dense: kv_indptr [B + 1] int32, kv_indices [nnz] int32 page ids, kv_lens [B] int32, page_size
        (a power of two 1..128); max_len (the longest kv_lens) spares a device -> host read.
    Sparse: token_indices [B, topk] int32 rows of kv_rows, -1 = masked (never read); the page
        table is not read.
    num_splits, pv ("fp8" | "f16"), block_n, block_h, num_warps, num_stages, ctas_per_sm, q_pre
        (quantize the query in its own launch, [B, H, 2, 576] e4m3 + [B, H] fp32, instead of in every
        program; not used by ds_scales="widen", which reads the 16-bit query) : tuning; None takes ``GPU_DEFAULTS`` (CPU: one split, fp32 16-bit paths).

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32 (natural log).

    Cost: reads L * 576 (per-tensor) or L * 656 (ds_mla) bytes of KV, L = sum kv_lens (dense) or the
    valid slots (sparse), + B * H * 576 * 2 of queries; each of cdiv(H, block_h) head blocks reads
    the rows again (from L2 when the blocks run together). 2 * H * L * (576 + 512) FLOPs, twice
    that on FP8 MMAs for "accurate" (hi + lo terms); ds_scales="widen": bf16 MMAs, "accurate"
    doubling the P.V half. With S > 1 splits, B * H * S * 513 * 4 bytes
    of partials written and read back by ``mla_merge``; the query launch (q_pre) writes and the
    decode reads B * H * (1152 + 4) bytes.
    """
    check_options(kv_layout, precision, pv, ds_scales)
    B, H = check_query(q_nope, q_pe)
    dev = q_nope.device
    check_rows(kv_rows, kv_layout, dev)
    if kv_layout == "fp8_ds_mla" and k_scale != 1.0:
        raise ValueError(f"mla_decode_fp8_rows: k_scale={k_scale}; fp8_ds_mla rows carry their own scales (use 1.0)")
    sparse = token_indices is not None
    if sparse:
        if token_indices.dim() != 2 or token_indices.shape[0] != B:
            raise ValueError(f"mla_decode_fp8_rows: token_indices must be [{B}, topk], "
                             f"got {tuple(token_indices.shape)}")
        tok = check_int32("token_indices", token_indices, None, dev)
        topk = max_len = tok.shape[1]
        indptr = indices = lens = tok
        page = 1
    else:
        check_page_size(page_size, kv_rows)
        indptr = check_int32("kv_indptr", kv_indptr, (B + 1,), dev)
        lens = check_int32("kv_lens", kv_lens, (B,), dev)
        indices = check_int32("kv_indices", kv_indices, None, dev)
        tok, topk, page = lens, 0, page_size
    cfg = rows_config(kv_layout, precision, H, dev, pv=pv, block_n=block_n, block_h=block_h, num_warps=num_warps,
                      num_stages=num_stages, ctas_per_sm=ctas_per_sm, q_pre=q_pre, ds_scales=ds_scales)
    num_splits = resolve_splits("mla_decode_fp8_rows", num_splits, B, triton.cdiv(H, cfg.block_h), lens, max_len,
                                cfg.block_n, dev, cfg.ctas_per_sm)
    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev)
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    grid, q_grid = grids(cfg, B, H, num_splits)
    q8 = qsc = lse_buf
    if cfg.quantize is not None:
        q8 = torch.empty(B, H, 2, 576, dtype=torch.float8_e4m3fn, device=dev)
        qsc = torch.empty(B, H, dtype=torch.float32, device=dev)
        quantize_query(query_launcher(cfg, q_grid), q_nope, q_pe, q8, qsc)
    launch_rows(rows_launcher(cfg, grid, sparse=sparse, page=page, direct=direct), q_nope, q_pe,
                rows_views(kv_rows, kv_layout), indptr, indices, lens, tok, q8, qsc, o_buf, lse_buf,
                float(sm_scale) * float(k_scale) * LOG2E, float(k_scale) / P_SCALE, topk)
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, float(k_scale))
    return (out, lse) if return_lse else out
