"""A numerical model of split-KV MLA decode on FP8 tensor cores, to ask where an error comes from.

Hopper's FP8 MMA does not accumulate in full fp32: within one instruction the products and the
incoming accumulator are aligned to the largest of them and kept to a limited number of bits
(about 14 measured by DeepSeek-V3 on an H800; the exact rule is not published). ``aligned_sum``
models one such step: every term truncated toward zero at 2^(e_max - bits), summed exactly,
rounded to fp32. ``decode`` runs the accurate Gluon kernel's arithmetic in float64 with that step
in place of each k-step of 32: scores over 576 dims (q as hi + lo e4m3 terms into one
accumulator), an online softmax per tile of 64 tokens, p as hi + lo e4m3 terms, p @ V
accumulated over the whole split in the MMA accumulator (rescaled in fp32 each tile), splits
merged exactly. ``bits=None`` is exact accumulation; ``promote=True`` gives each tile's p @ V a
fresh MMA accumulator added into an fp32 one (DeepGEMM's promotion).

    out = decode(q, kv, split_len=2048, bits=13)        # q [B, H, 576], kv [B, L, 576] float64
"""
from __future__ import annotations

import torch

from .kvlayout import E4M3_MAX

K_STEP = 32  # e4m3 wgmma: k = 32 a step
TILE = 64  # tokens a tile


def aligned_sum(terms: torch.Tensor, bits: int | None) -> torch.Tensor:
    """terms [..., n] float64 -> [...]: their sum as one MMA step keeps it (see the module doc);
    ``bits`` None: the exact sum rounded to fp32."""
    if bits is not None:
        top = terms.abs().amax(-1, keepdim=True)
        ulp = torch.exp2(torch.floor(torch.log2(top.clamp_min(1e-300))) - bits)
        terms = torch.trunc(terms / ulp) * ulp
    return terms.sum(-1).float().double()


def mma(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int | None) -> torch.Tensor:
    """acc [..., M, N] + a [..., M, K] @ b [..., K, N], one ``aligned_sum`` per k-step of 32."""
    for k0 in range(0, a.shape[-1], K_STEP):
        prod = a[..., :, k0:k0 + K_STEP, None] * b[..., None, k0:k0 + K_STEP, :]  # [..., M, k, N]
        acc = aligned_sum(torch.cat([acc[..., None, :], prod], -2).transpose(-1, -2), bits)
    return acc


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()


def split_terms(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~= scale * (hi + lo), both e4m3 (x / scale within e4m3's range)."""
    hi = e4m3(x / scale)
    return hi, e4m3(x / scale - hi)


def decode(q: torch.Tensor, kv: torch.Tensor, split_len: int, bits: int | None, sm_scale: float = 1 / 16,
           promote: bool = False) -> torch.Tensor:
    """q [B, H, 576], kv [B, L, 576] float64 (KV's real values: e4m3 times k_scale) -> out [B, H, 512]
    float64, as the accurate split-KV kernel computes it (module doc). L a multiple of 64."""
    B, H, _ = q.shape
    L = kv.shape[1]
    q_sc = q.abs().amax(-1, keepdim=True) / 28  # the kernel's q / q_sc <= 28
    q_hi, q_lo = split_terms(q, q_sc)
    outs, lses = [], []
    for s0 in range(0, L, split_len):
        m = torch.full((B, H, 1), -torch.inf, dtype=torch.float64)
        l = torch.zeros(B, H, 1, dtype=torch.float64)
        acc = torch.zeros(B, H, 512, dtype=torch.float64)  # the MMA accumulator
        total = torch.zeros(B, H, 512, dtype=torch.float64)  # fp32 registers (promote)
        for t0 in range(s0, min(s0 + split_len, L), TILE):
            k = kv[:, t0:t0 + TILE].transpose(1, 2)  # [B, 576, T]
            s = mma(torch.zeros(B, H, k.shape[-1], dtype=torch.float64), q_hi, k, bits)
            s = mma(s, q_lo, k, bits) * q_sc * sm_scale
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            p_hi, p_lo = split_terms(p, torch.full_like(m, 1 / 256))  # the kernel's p x 256
            v = kv[:, t0:t0 + TILE, :512]
            if promote:
                step = mma(mma(torch.zeros_like(acc), p_hi, v, bits), p_lo, v, bits)
                total = (total * alpha + step / 256).float().double()
            else:
                acc = mma(mma((acc * alpha).float().double(), p_hi, v, bits), p_lo, v, bits)
            m = m_new
        part = total if promote else acc / 256
        outs.append(part / l)
        lses.append(m + torch.log(l))
    lse = torch.stack(lses)  # [S, B, H, 1]
    w = torch.softmax(lse, 0)
    return (torch.stack(outs) * w).sum(0)
