"""Paged absorbed-MLA decode over a 16-bit (BF16/FP16) KV pool, split-KV (flash-decoding).

Per request b and head h:  s_j = sm_scale * (q_nope[b,h] . ckv_j + q_pe[b,h] . kpe_j) over the
kv_lens[b] tokens j of its pages, out[b,h] = v_scale * softmax(s) @ ckv, lse[b,h] = logsumexp(s).
Stage 1 (this file): grid (B, head blocks, splits); each program runs an online softmax over its
split's tiles of BLOCK_N tokens and writes a normalised partial output and its log2-sum-exp.
Stage 2 (``mla_merge``) merges the splits. With one split stage 1 writes the result directly.

16-bit KV only: given FP8 pages it refuses before any launch, the lab's counterpart of
FlashInfer's ``static_assert(sizeof(DType) == 2)``; ``mla_decode_fp8`` reads FP8.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .mla_merge import mla_merge, round_to_bf16

LOG2E = 1.4426950408889634
D_CKV, D_KPE = 512, 64
NUM_SMS_DEFAULT = 132  # H200; the launcher reads the device's count when it has one


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_decode_kernel(
    q_nope_ptr,  # *[B, H, 512] 16-bit, last dim contiguous
    q_pe_ptr,  # *[B, H, 64]
    kv_ptr,  # *[num_pages, PAGE, 576] 16-bit; a token row is 576 contiguous values
    kv_indptr_ptr,  # *i32 [B + 1]
    kv_indices_ptr,  # *i32 [nnz] page ids
    kv_lens_ptr,  # *i32 [B] tokens of each request
    o_ptr,  # *f32 [B, H, S, 512] partials, or *q dtype [B, H, 512] when DIRECT
    lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
    qk_scale,  # sm_scale * log2(e): scores in base 2
    out_scale,  # v_scale (DIRECT only)
    H,
    num_splits,  # S
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_page,  # kv.stride(0) in elements
    stride_o_b, stride_o_h,  # of the DIRECT output
    PAGE: tl.constexpr,  # page_size
    BLOCK_N: tl.constexpr,  # tokens per tile
    BLOCK_H: tl.constexpr,  # heads per program (>= 16 for tl.dot)
    DIRECT: tl.constexpr,  # one split: write the final output and natural-log lse
    F32_MATH: tl.constexpr,  # widen to fp32 before the dots (the CPU interpreter's bf16 is wrong)
):
    DC: tl.constexpr = 512
    DP: tl.constexpr = 64
    D: tl.constexpr = 576
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

    q_n = tl.load(q_nope_ptr + b * stride_qn_b + heads[:, None] * stride_qn_h + dc[None, :],
                  mask=hmask[:, None], other=0.0)  # [BLOCK_H, 512]
    q_p = tl.load(q_pe_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h + dp[None, :],
                  mask=hmask[:, None], other=0.0)  # [BLOCK_H, 64]
    if F32_MATH:
        q_n = q_n.to(tl.float32)
        q_p = q_p.to(tl.float32)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token within the request
        nmask = offs_n < end
        if PAGE >= BLOCK_N:  # the whole tile lies in one page
            page = tl.load(kv_indices_ptr + page_base + n0 // PAGE).to(tl.int64)
            rows = page * stride_page + (offs_n % PAGE) * D  # [BLOCK_N]
        else:
            page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE, mask=nmask, other=0)
            rows = page.to(tl.int64) * stride_page + (offs_n % PAGE) * D
        ckv = tl.load(kv_ptr + rows[:, None] + dc[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, 512]
        kpe = tl.load(kv_ptr + rows[:, None] + DC + dp[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, 64]
        if F32_MATH:
            ckv = ckv.to(tl.float32)
            kpe = kpe.to(tl.float32)
        s = tl.dot(q_n, tl.trans(ckv)) + tl.dot(q_p, tl.trans(kpe))  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(nmask[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(ckv.dtype), ckv)
        m_i = m_new

    l_safe = tl.maximum(l_i, 1e-30)
    inv = tl.where(l_i > 0, 1.0 / l_safe, 0.0)
    if DIRECT:
        out = acc * (inv * out_scale)[:, None]
        if F32_MATH:  # the interpreter truncates fp32 -> bf16: round first (no-op for fp16 outputs)
            if o_ptr.dtype.element_ty == tl.bfloat16:
                out = round_to_bf16(out)
        tl.store(o_ptr + b * stride_o_b + heads[:, None] * stride_o_h + dc[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
        tl.store(lse_ptr + b * H + heads, lse, mask=hmask)
    else:
        row = (b * H + heads) * num_splits + split  # [BLOCK_H] row of [B*H*S]
        tl.store(o_ptr + row[:, None] * DC + dc[None, :], acc * inv[:, None], mask=hmask[:, None])
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf"))
        tl.store(lse_ptr + row, lse2, mask=hmask)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return NUM_SMS_DEFAULT


def default_num_splits(batch: int, head_blocks: int, max_len: int, block_n: int, device,
                       ctas_per_sm: float = 2.0, min_tiles: int = 4, max_splits: int = 64) -> int:
    """The most splits with batch x head blocks x splits <= ctas_per_sm x SMs (rounding DOWN: a
    partial last wave of long programs costs a whole wave), each split keeping at least
    ``min_tiles`` tiles, at most ``max_splits``. ``ctas_per_sm`` per kernel config is measured
    (docs/perf-notes.md). On the CPU: 1 (as few interpreter programs as possible)."""
    if device.type != "cuda":
        return 1
    want = math.floor(ctas_per_sm * num_sms(device) / max(1, batch * head_blocks))
    most = max(1, triton.cdiv(max_len, block_n * min_tiles))
    return int(max(1, min(want, most, max_splits)))


def resolve_splits(kernel: str, num_splits, batch: int, head_blocks: int, kv_lens, max_len, block_n: int,
                   device, ctas_per_sm: float, min_tiles: int = 4, max_splits: int = 64) -> int:
    """``num_splits`` as given, else one wave of ``ctas_per_sm`` CTAs per SM (``default_num_splits``,
    at least ``min_tiles`` tiles a split, at most ``max_splits``); ``max_len`` (the longest kv_lens)
    spares a device -> host read."""
    if num_splits is None:
        if max_len is None:
            max_len = int(kv_lens.max()) if batch else 0
        num_splits = default_num_splits(batch, head_blocks, max_len, block_n, device, ctas_per_sm=ctas_per_sm,
                                        min_tiles=min_tiles, max_splits=max_splits)
    if num_splits < 1:
        raise ValueError(f"{kernel}: num_splits={num_splits} must be >= 1")
    return num_splits


def decode_buffers(batch: int, heads: int, num_splits: int, out_dtype, device, part_dtype=torch.float32):
    """What stage 1 writes: with one split (or no request) the final out [B, H, 512] and lse [B, H];
    else partials [B, H, S, 512] ``part_dtype`` (fp32, or bf16 for the fast precision) and fp32
    log2-sum-exp [B, H, S] for ``mla_merge``. Returns (direct, o_buf, lse_buf)."""
    if num_splits == 1 or batch == 0:
        return (True, torch.empty(batch, heads, D_CKV, dtype=out_dtype, device=device),
                torch.empty(batch, heads, dtype=torch.float32, device=device))
    return (False, torch.empty(batch, heads, num_splits, D_CKV, dtype=part_dtype, device=device),
            torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device))


def check_decode_args(kernel: str, q_nope, q_pe, kv_buffer, kv_indptr, kv_indices, kv_lens,
                      kv_dtypes: tuple, q_dtypes: tuple = (torch.bfloat16, torch.float16), row: int = D_CKV + D_KPE):
    """Validate the decode interface; raise ValueError naming the argument. Returns (B, H, page_size)."""
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_buffer", kv_buffer), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if kv_buffer.dtype not in kv_dtypes:
        raise ValueError(
            f"{kernel}: kv_buffer has dtype {kv_buffer.dtype}; this kernel reads only "
            f"{[str(d) for d in kv_dtypes]} KV (16-bit MMA operands, like FlashInfer's "
            f"static_assert(sizeof(DType) == 2))" if kernel == "mla_decode" else
            f"{kernel}: kv_buffer has dtype {kv_buffer.dtype}; allowed {[str(d) for d in kv_dtypes]}")
    if q_nope.dim() != 3 or q_nope.shape[-1] != D_CKV:
        raise ValueError(f"{kernel}: q_nope must be [B, H, {D_CKV}], got {tuple(q_nope.shape)}")
    B, H, _ = q_nope.shape
    if q_pe.shape != (B, H, D_KPE):
        raise ValueError(f"{kernel}: q_pe must be [{B}, {H}, {D_KPE}], got {tuple(q_pe.shape)}")
    if q_nope.dtype not in q_dtypes or q_pe.dtype != q_nope.dtype:
        raise ValueError(f"{kernel}: q_nope/q_pe dtypes {q_nope.dtype}/{q_pe.dtype}; allowed one of "
                         f"{[str(d) for d in q_dtypes]} for both")
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError(f"{kernel}: q_nope and q_pe need a contiguous last dim")
    if not 1 <= H <= 128:
        raise ValueError(f"{kernel}: q_nope has {H} heads; allowed 1..128")
    if kv_buffer.dim() != 3 or kv_buffer.shape[-1] != D_CKV + D_KPE:
        raise ValueError(f"{kernel}: kv_buffer must be [num_pages, page_size, {D_CKV + D_KPE}], "
                         f"got {tuple(kv_buffer.shape)}")
    page_size = kv_buffer.shape[1]
    if page_size < 1 or page_size > 128 or page_size & (page_size - 1):
        raise ValueError(f"{kernel}: kv_buffer page_size={page_size}; allowed powers of two 1..128")
    if kv_buffer.stride(2) != 1 or kv_buffer.stride(1) != row or kv_buffer.stride(0) % 16:
        raise ValueError(f"{kernel}: kv_buffer strides {tuple(kv_buffer.stride())}: token rows must be "
                         f"contiguous and the page stride a multiple of 16")
    for name, t, n in (("kv_indptr", kv_indptr, B + 1), ("kv_lens", kv_lens, B), ("kv_indices", kv_indices, None)):
        if t.dim() != 1 or (n is not None and t.numel() != n):
            raise ValueError(f"{kernel}: {name} must be 1-D" + (f" with {n} entries" if n else "") +
                             f", got {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise ValueError(f"{kernel}: {name} has dtype {t.dtype}; expected torch.int32")
        if not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} must be contiguous")
    for name, t in (("q_pe", q_pe), ("kv_buffer", kv_buffer), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        if t.device != q_nope.device:
            raise ValueError(f"{kernel}: {name} is on {t.device}, q_nope on {q_nope.device}")
    return B, H, page_size


def pick_block_h(H: int, block_h: int | None) -> int:
    if block_h is None:
        block_h = 64 if H > 32 else max(16, triton.next_power_of_2(H))
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h={block_h}: must be a power of two >= 16")
    return block_h


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
               kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, v_scale: float = 1.0,
               num_splits: int | None = None, return_lse: bool = False, *, block_n: int | None = None,
               block_h: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
               max_len: int | None = None):
    """Paged absorbed-MLA decode over 16-bit KV.

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_buffer : [num_pages, page_size, 576] bf16 or fp16: ckv = [..., :512], kpe = [..., 512:];
        page_size a power of two 1..128. FP8 is refused (ValueError) before any launch.
    kv_indptr : [B + 1] int32; request b reads pages kv_indices[kv_indptr[b]:kv_indptr[b+1]].
    kv_indices : [nnz] int32 page ids.
    kv_lens : [B] int32 tokens of each request (>= 0; the last page may be partial).
    sm_scale : softmax scale (fold k_scale in here for a scaled pool).
    v_scale : multiplies the output (real V = stored V * v_scale).
    num_splits : splits of each request's tokens; None picks one to fill the GPU.
    return_lse : also return lse.
    block_n, block_h, num_warps, num_stages, max_len : tuning; max_len (the longest kv_lens) saves a
        device->host read when num_splits is None.

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32, natural log of
        sum_j exp(sm_scale * score_j) (-inf for an empty request, whose out is 0).

    Cost: reads L*576*2 B of KV (L = sum kv_lens) + queries; 2*H*L*(576+512) FLOPs;
    partials B*H*S*513*4 B written and read back when S > 1.
    """
    B, H, page_size = check_decode_args("mla_decode", q_nope, q_pe, kv_buffer, kv_indptr, kv_indices,
                                        kv_lens, kv_dtypes=(torch.bfloat16, torch.float16))
    if kv_buffer.dtype != q_nope.dtype:
        raise ValueError(f"mla_decode: kv_buffer dtype {kv_buffer.dtype} must equal q_nope dtype {q_nope.dtype}")
    dev = q_nope.device
    on_gpu = dev.type == "cuda"
    block_h = pick_block_h(H, block_h)
    big = block_h >= 64  # measured on the H200 (data/kernels/h200_run1.*): bf16.pipe32 / bf16.pipe64
    if block_n is None:
        block_n = (64 if big else 32) if on_gpu else 128
    if num_warps is None:
        num_warps = 8 if big else 4
    if num_stages is None:
        num_stages = 2 if big else 3
    head_blocks = triton.cdiv(H, block_h)
    num_splits = resolve_splits("mla_decode", num_splits, B, head_blocks, kv_lens, max_len, block_n, dev,
                                ctas_per_sm=2 if big else 4)
    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev)
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    _mla_decode_kernel[(B, head_blocks, num_splits)](
        q_nope, q_pe, kv_buffer, kv_indptr, kv_indices, kv_lens, o_buf, lse_buf,
        float(sm_scale) * LOG2E, float(v_scale), H, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_buffer.stride(0),
        o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, BLOCK_N=block_n, BLOCK_H=block_h, DIRECT=direct,
        F32_MATH=not on_gpu, num_warps=num_warps, num_stages=num_stages,
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, v_scale)
    return (out, lse) if return_lse else out
