"""Paged absorbed-MLA decode reading FP8 (e4m3) KV pages directly: dequantized in registers.

The same split-KV decode as ``mla_decode`` (stage 2 is ``mla_merge``), but the pages stay FP8 in
memory: each tile is loaded as FP8 (16-byte loads) and widened in registers; there is no 16-bit
copy of KV anywhere. The per-tensor scales never touch the tile: ``k_scale`` is folded into the
softmax scale and ``v_scale`` into the output, so the widening is exact.

Variants (constexpr, chosen by the launcher from ``default_config``):
  F32      the CPU interpreter (its 16-bit dots are wrong): FP8 tiles widened to fp32, fp32 dots.
           On the GPU a tile is widened to fp16 by ``cvt.rn.f16x2.e4m3x2`` as non-pure inline PTX:
           converted once, in registers, the fp16 tile going through shared memory to ldmatrix
           (a plain ``.to()`` is moved after the shared-memory load by Triton, so p @ v read the
           FP8 tile byte by byte: docs/perf-notes.md, v1 and v2)
  Q_FP8    scores by an FP8 tl.dot (the trtllm_mla path; wgmma QGMMA with SWAP): ~3e-2 rel. error.
           one scale per (request, head block): amax of the program's q tile / 448.
           2: each program quantizes its own q tile in registers: no extra launch (GPU);
           1: the same quantization by torch in the launcher (the CPU interpreter's f32 -> fp8
              casts are wrong), scales read from q_scale_ptr
  SWAP     0: s = q @ K^T (heads on the MMA's M side: mma.sync for BLOCK_H < 64);
           1: s^T = K @ q^T (tokens on M: wgmma for few heads)
The variants no default took (``.to(bf16/fp16)`` widening, register prefetch, out^T = V^T @ p^T,
an FP8 p @ v) are in the git history and docs/perf-notes.md, with their measurements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla_decode import (LOG2E, check_decode_args, decode_buffers, pick_block_h,
                         resolve_splits)
from .mla_merge import mla_merge, round_to_bf16

E4M3_MAX = 448.0


@triton.jit
def _widen(x, F32: tl.constexpr):
    """An FP8 tile in the dtype of the dots: fp32 under F32, else fp16 by the cvt as non-pure inline
    PTX (Triton cannot move it past the shared-memory load, where fp8 would be read byte by byte)."""
    if F32:
        return x.to(tl.float32)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
        is_pure=False, pack=4)


@triton.jit
def _tile_rows(kv_indices_ptr, page_base, n0, end, stride_page, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row offsets (elements) of tokens n0 .. n0 + BLOCK_N of a request, and which are < end."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    if PAGE >= BLOCK_N:  # the tile lies in one page
        page = tl.load(kv_indices_ptr + page_base + n0 // PAGE, mask=n0 < end, other=0).to(tl.int64)
        rows = page * stride_page + (offs_n % PAGE) * 576
    else:
        page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE, mask=nmask, other=0)
        rows = page.to(tl.int64) * stride_page + (offs_n % PAGE) * 576
    return rows, nmask


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_decode_fp8_kernel(
    q_nope_ptr,  # *[B, H, 512] bf16/fp16 (fp8 when Q_FP8 == 1); last dim contiguous
    q_pe_ptr,  # *[B, H, 64]
    kv_ptr,  # *fp8e4nv [num_pages, PAGE, 576]; a token row is 576 contiguous bytes
    kv_indptr_ptr,  # *i32 [B + 1]
    kv_indices_ptr,  # *i32 [nnz] page ids
    kv_lens_ptr,  # *i32 [B]
    o_ptr,  # *f32 [B, H, S, 512] partials, or *out dtype [B, H, 512] when DIRECT
    lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
    q_scale_ptr,  # *f32 [B, head blocks] scales of an FP8 query (read when Q_FP8 == 1): no host sync
    qk_scale,  # sm_scale * k_scale * log2(e)
    out_scale,  # v_scale; DIRECT only
    H,
    num_splits,  # S
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_page,  # kv.stride(0), in elements (= bytes)
    stride_o_b, stride_o_h,
    PAGE: tl.constexpr,  # page_size
    BLOCK_N: tl.constexpr,  # tokens per tile
    BLOCK_H: tl.constexpr,  # heads per program (>= 16)
    DIRECT: tl.constexpr,  # one split: write the final output and natural-log lse
    F32: tl.constexpr,  # the interpreter: fp32 tiles and dots
    Q_FP8: tl.constexpr,  # scores by an FP8 dot: 0 no, 1 q given in FP8, 2 quantized here
    SWAP: tl.constexpr,  # 0: q @ K^T; 1: scores as K @ q^T (p @ V either way)
):
    DC: tl.constexpr = 512
    DP: tl.constexpr = 64
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    hmask = heads < H
    dc = tl.arange(0, DC)
    dp = tl.arange(0, DP)

    seq_len = tl.load(kv_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    if SWAP == 0:  # [BLOCK_H, 512], [BLOCK_H, 64]
        q_n = tl.load(q_nope_ptr + b * stride_qn_b + heads[:, None] * stride_qn_h + dc[None, :],
                      mask=hmask[:, None], other=0.0)
        q_p = tl.load(q_pe_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h + dp[None, :],
                      mask=hmask[:, None], other=0.0)
    else:  # q^T: [512, BLOCK_H], [64, BLOCK_H]
        q_n = tl.load(q_nope_ptr + b * stride_qn_b + heads[None, :] * stride_qn_h + dc[:, None],
                      mask=hmask[None, :], other=0.0)
        q_p = tl.load(q_pe_ptr + b * stride_qp_b + heads[None, :] * stride_qp_h + dp[:, None],
                      mask=hmask[None, :], other=0.0)
    if Q_FP8 == 1:
        qk_scale = qk_scale * tl.load(q_scale_ptr + b * tl.num_programs(1) + hblk)
    elif Q_FP8 == 2:  # this program's q tile in e4m3 with its own scale
        amax = tl.maximum(tl.max(tl.abs(q_n.to(tl.float32))), tl.max(tl.abs(q_p.to(tl.float32))))
        q_sc = tl.maximum(amax, 1e-12) / 448.0
        q_n = (q_n.to(tl.float32) / q_sc).to(tl.float8e4nv)
        q_p = (q_p.to(tl.float32) / q_sc).to(tl.float8e4nv)
        qk_scale = qk_scale * q_sc
    elif F32:
        q_n = q_n.to(tl.float32)
        q_p = q_p.to(tl.float32)
    else:
        q_n = q_n.to(tl.float16)
        q_p = q_p.to(tl.float16)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        rows, nmask = _tile_rows(kv_indices_ptr, page_base, n0, end, stride_page, PAGE, BLOCK_N)
        ckv8 = tl.load(kv_ptr + rows[:, None] + dc[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, 512]
        kpe8 = tl.load(kv_ptr + rows[:, None] + DC + dp[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, 64]
        v = _widen(ckv8, F32)
        if Q_FP8:  # fp8 x fp8 scores
            k_n = ckv8
            k_p = kpe8
        else:
            k_n = v
            k_p = _widen(kpe8, F32)

        if SWAP == 1:
            s = tl.trans(tl.dot(k_n, q_n) + tl.dot(k_p, q_p))  # [BLOCK_H, BLOCK_N]
        else:
            s = tl.dot(q_n, tl.trans(k_n)) + tl.dot(q_p, tl.trans(k_p))
        s = tl.where(nmask[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.maximum(l_i, 1e-30)
    inv = tl.where(l_i > 0, 1.0 / l_safe, 0.0)
    if DIRECT:
        out = acc * (inv * out_scale)[:, None]
        if F32:  # the interpreter truncates fp32 -> bf16: round first (no-op for fp16 outputs)
            if o_ptr.dtype.element_ty == tl.bfloat16:
                out = round_to_bf16(out)
        tl.store(o_ptr + b * stride_o_b + heads[:, None] * stride_o_h + dc[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        tl.store(lse_ptr + b * H + heads, lse, mask=hmask)
    else:
        row = (b * H + heads) * num_splits + split
        tl.store(o_ptr + row[:, None] * DC + dc[None, :], acc * inv[:, None], mask=hmask[:, None])
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf"))
        tl.store(lse_ptr + row, lse2, mask=hmask)


def quantize_q_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, block_h: int):
    """e4m3 query with one scale per (request, block of ``block_h`` heads), as the kernel's
    Q_FP8 == 2 path computes it in registers: returns (q_nope8, q_pe8, q_scale [B, head_blocks] f32)."""
    B, H, _ = q_nope.shape
    hb = triton.cdiv(H, block_h)
    pad = hb * block_h - H
    amax = torch.maximum(q_nope.abs().amax(-1), q_pe.abs().amax(-1)).float()  # [B, H]
    amax = torch.nn.functional.pad(amax, (0, pad)).view(B, hb, block_h).amax(-1)  # [B, hb]
    q_scale = amax.clamp_min(1e-12) / E4M3_MAX
    per_head = q_scale.repeat_interleave(block_h, dim=1)[:, :H, None]  # [B, H, 1]
    qn8 = (q_nope.float() / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    qp8 = (q_pe.float() / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return qn8, qp8, q_scale.contiguous()


# Measured on the H200 (scripts/gpu_kernels.py -> data/kernels/h200_run1.*; docs/perf-notes.md):
# the fastest checked variant per head class, with and without an FP8 query, and the CTAs per SM
# its split count aims at. The FP8-query variants are the faster ones: they are the default.
GPU_DEFAULTS = {
    ("small_h", True): dict(q_fp8=True, swap=1, block_n=128, num_warps=8, num_stages=2,
                            ctas_per_sm=2),  # fp8.q8_pipe128_swap1_w8
    ("large_h", True): dict(q_fp8=True, swap=0, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1),  # fp8.q8_pipe64
    ("small_h", False): dict(q_fp8=False, swap=0, block_n=64, num_warps=4, num_stages=3,
                             ctas_per_sm=2),  # fp8.asm_pipe64
    ("large_h", False): dict(q_fp8=False, swap=0, block_n=64, num_warps=8, num_stages=2,
                             ctas_per_sm=1),  # fp8.asm_pipe64 (64+ heads)
}


def default_config(H: int, on_gpu: bool, q_fp8: bool | None = None) -> dict:
    """Tuning per head count (and query precision; None: the default, an FP8 query); the small-head
    configs need more shared memory than an sm_90 SM has once BLOCK_H reaches 32 heads. The CPU
    (interpreter) runs fp32 dots but keeps the FP8 query, so both compute the same function."""
    cfg = dict(GPU_DEFAULTS[("large_h" if H > 16 else "small_h", True if q_fp8 is None else bool(q_fp8))])
    if not on_gpu:
        cfg.update(swap=0, block_n=128, num_warps=4, num_stages=1)
    return cfg


def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                   v_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False, *,
                   q_fp8: bool | None = None, swap: int | None = None, block_n: int | None = None,
                   block_h: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   max_len: int | None = None):
    """Paged absorbed-MLA decode over an FP8 e4m3 pool, dequantizing in registers.

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_buffer : [num_pages, page_size, 576] float8_e4m3fn, real = stored * k_scale; page_size a
        power of two 1..128; token rows contiguous.
    kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 page ids; kv_lens : [B] int32.
    sm_scale : softmax scale. k_scale : per-tensor scale of the pool, folded into the scores.
    v_scale : scale of V, folded into the output; defaults to k_scale (ckv is both K and V).
    num_splits : splits per request (None: fill the GPU). return_lse : also return lse.
    q_fp8 : quantize q to e4m3 (one scale per request and head block) and compute the scores
        with an FP8 dot: the GPU default (faster); costs 2.5-2.6e-2 relative error against the exact
        result instead of 1.7e-3 (measured on the H200, run 6). In registers on the GPU, by torch on the CPU.
    swap : 0 or 1, the scores' orientation (module docstring); None takes ``default_config``.
        On the CPU (Triton interpreter) tiles and dots are fp32.
    block_n, block_h, num_warps, num_stages, max_len : tuning; max_len (the longest kv_lens)
        saves a device->host read when num_splits is None.

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32, natural log of
        sum_j exp(sm_scale * k_scale * (q_nope . ckv_j + q_pe . kpe_j)).

    Cost: reads L*576 B of KV (L = sum kv_lens) + queries; 2*H*L*(576+512) FLOPs; with S > 1
    splits, B*H*S*513*4 B of partials written and read back by ``mla_merge``.
    """
    B, H, page_size = check_decode_args("mla_decode_fp8", q_nope, q_pe, kv_buffer, kv_indptr, kv_indices,
                                        kv_lens, kv_dtypes=(torch.float8_e4m3fn,))
    dev = q_nope.device
    on_gpu = dev.type == "cuda"
    cfg = default_config(H, on_gpu, q_fp8)
    given = dict(q_fp8=q_fp8, swap=swap, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg.update({k: v for k, v in given.items() if v is not None})
    cfg.setdefault("ctas_per_sm", 2)
    if cfg["swap"] not in (0, 1):
        raise ValueError(f"mla_decode_fp8: swap={cfg['swap']!r}; allowed 0, 1")
    block_n = cfg["block_n"]
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"mla_decode_fp8: block_n={block_n}: must be a power of two >= 16")
    if v_scale is None:
        v_scale = k_scale
    block_h = pick_block_h(H, block_h)
    head_blocks = triton.cdiv(H, block_h)
    num_splits = resolve_splits("mla_decode_fp8", num_splits, B, head_blocks, kv_lens, max_len, block_n, dev,
                                cfg["ctas_per_sm"])

    qk_scale = float(sm_scale) * float(k_scale) * LOG2E
    out_scale = float(v_scale)
    q_scale, q_mode = None, 0
    if cfg["q_fp8"] and not on_gpu:
        qn, qp, q_scale = quantize_q_fp8(q_nope, q_pe, block_h)  # by torch, per (request, head block)
        q_mode = 1
    else:  # q is converted (or quantized, per program) inside the kernel
        qn, qp = q_nope, q_pe
        q_mode = 2 if cfg["q_fp8"] else 0

    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev)
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    _mla_decode_fp8_kernel[(B, head_blocks, num_splits)](
        qn, qp, kv_buffer, kv_indptr, kv_indices, kv_lens, o_buf, lse_buf,
        q_scale if q_scale is not None else lse_buf, qk_scale, out_scale, H, num_splits,
        qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), kv_buffer.stride(0),
        o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, BLOCK_N=block_n, BLOCK_H=block_h, DIRECT=direct,
        F32=not on_gpu, Q_FP8=q_mode, SWAP=int(cfg["swap"]), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, out_scale)
    return (out, lse) if return_lse else out
