"""Merge the split-KV partial results of an MLA decode by log-sum-exp (flash-decoding stage 2).

Used by ``mla_decode`` and ``mla_decode_fp8``. Split s of request b holds, per head,
o_s = sum_j p_j v_j / sum_j p_j (normalised) and lse2_s = log2(sum_j exp2(qk_scale * s_j)),
-inf for an empty split. Then out = v_scale * sum_s w_s o_s with w_s = 2^(lse2_s - lse2),
lse2 = log2(sum_s 2^lse2_s), and lse (natural log) = lse2 * ln 2.
Bytes: B*H*S*(512*part bytes + 4) read (part bytes 4, or 2 for bf16 partials), B*H*(512*out bytes + 4) written; ~2*B*H*S*512 FLOPs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LN2 = 0.6931471805599453
PART_DTYPES = (torch.float32, torch.bfloat16)  # what stage 1 may write its partial outputs in


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the bf16 nearest to x (ties to even). The CPU interpreter's fp32 -> bf16
    cast truncates; rounding first makes that cast exact, so CPU results round like the GPU's."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_merge_kernel(
    part_out_ptr,  # *f32 or *bf16 [B, H, S, DV], contiguous
    part_lse_ptr,  # *f32 [B, H, S] log2 of each split's sum of exp2, contiguous
    out_ptr,  # *q dtype [B, H, DV]
    lse_ptr,  # *f32 [B, H] natural log
    H,
    stride_ob,  # out.stride(0)
    stride_oh,  # out.stride(1)
    out_scale,  # v_scale (and any fold-in factor)
    num_splits,  # S
    S_POW2: tl.constexpr,  # next power of two >= S
    DV: tl.constexpr,  # 512
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_D: tl.constexpr,  # output columns per program (a divisor of DV)
    RNE_BF16: tl.constexpr,  # round to bf16 before the store (CPU interpreter, bf16 output)
):
    # grid (B, head blocks, DV / BLOCK_D): at batch 1 the columns spread the work over the chip;
    # all splits of a (head, column block) are loaded as one tile, so their loads are in flight together
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    hmask = heads < H
    bh = b * H + heads  # [BLOCK_H] row of [B*H]
    splits = tl.arange(0, S_POW2)
    lse2 = tl.load(part_lse_ptr + bh[:, None] * num_splits + splits[None, :],
                   mask=hmask[:, None] & (splits[None, :] < num_splits), other=-float("inf"))
    m = tl.max(lse2, 1)  # [BLOCK_H]
    m_safe = tl.where(m == -float("inf"), 0.0, m)  # an empty request: every split -inf
    w = tl.exp2(lse2 - m_safe[:, None])  # [BLOCK_H, S_POW2], 0 for empty splits
    total = tl.sum(w, 1)  # [BLOCK_H]
    inv = tl.where(total > 0, 1.0 / tl.maximum(total, 1e-30), 0.0)
    dv = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = bh[:, None] * num_splits + splits[None, :]  # [BLOCK_H, S_POW2]
    # empty splits are never read: their partials were never written
    o = tl.load(part_out_ptr + rows[:, :, None] * DV + dv[None, None, :],
                mask=(hmask[:, None] & (w > 0))[:, :, None], other=0.0).to(tl.float32)  # [BLOCK_H, S_POW2, BLOCK_D]
    acc = tl.sum(w[:, :, None] * o, 1)  # [BLOCK_H, BLOCK_D]
    acc = acc * (inv * out_scale)[:, None]
    if RNE_BF16:
        acc = round_to_bf16(acc)
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    lse = tl.where(total > 0, (m_safe + tl.log2(tl.maximum(total, 1e-30))) * 0.6931471805599453, -float("inf"))
    tl.store(lse_ptr + bh, lse, mask=hmask & (tl.program_id(2) == 0))


def mla_merge(part_out: torch.Tensor, part_lse: torch.Tensor, out_dtype: torch.dtype,
              out_scale: float = 1.0, *, block_h: int | None = None, block_d: int | None = None,
              num_warps: int = 4):
    """Merge split-KV partials.

    Parameters
    ----------
    part_out : torch.Tensor
        [B, H, S, DV] ``torch.float32`` (or ``torch.bfloat16``: half the bytes, for the fast
        precision) contiguous, each split's normalised output (unwritten
        splits must have part_lse = -inf).
    part_lse : torch.Tensor
        [B, H, S] ``torch.float32`` contiguous, log2 of each split's softmax denominator.
    out_dtype : dtype of the output (the query's).
    out_scale : float multiplied into the output (v_scale).

    Returns
    -------
    (out [B, H, DV] ``out_dtype``, lse [B, H] ``torch.float32``, natural log).
    """
    if part_out.dim() != 4 or part_out.dtype not in PART_DTYPES or not part_out.is_contiguous():
        raise ValueError(f"part_out must be a contiguous float32 or bfloat16 [B, H, S, DV] tensor, got "
                         f"{tuple(part_out.shape)} {part_out.dtype}")
    B, H, S, DV = part_out.shape
    if part_lse.shape != (B, H, S) or part_lse.dtype != torch.float32 or not part_lse.is_contiguous():
        raise ValueError(f"part_lse must be a contiguous float32 [{B}, {H}, {S}] tensor, got "
                         f"{tuple(part_lse.shape)} {part_lse.dtype}")
    if DV & (DV - 1):
        raise ValueError(f"part_out: DV={DV} must be a power of two")
    out = torch.empty(B, H, DV, dtype=out_dtype, device=part_out.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=part_out.device)
    s_pow2 = triton.next_power_of_2(S)
    if part_out.device.type == "cpu":  # the interpreter: as few programs as possible
        block_d = block_d or DV
        block_h = block_h or 16
    else:  # about 8K partial values a program (32 per thread at 4 warps): enough programs at batch 1
        block_d = block_d or min(DV, 128)
        block_h = block_h or max(1, 8192 // (s_pow2 * block_d))
    block_h = min(block_h, triton.next_power_of_2(H))
    if DV % block_d or block_d & (block_d - 1):
        raise ValueError(f"mla_merge: block_d={block_d} must be a power of two dividing DV={DV}")
    grid = (B, triton.cdiv(H, block_h), DV // block_d)
    _mla_merge_kernel[grid](
        part_out, part_lse, out, lse, H, out.stride(0), out.stride(1), float(out_scale),
        S, S_POW2=s_pow2, DV=DV, BLOCK_H=block_h, BLOCK_D=block_d,
        RNE_BF16=(out_dtype == torch.bfloat16 and part_out.device.type == "cpu"), num_warps=num_warps,
    )
    return out, lse
