"""The oracle: absorbed MLA decode in float64 (or float32) torch, one request at a time.

Every correctness test compares against this module; no backend imports it.
"""
from __future__ import annotations

import torch

from .kvpool import DecodeBatch


def request_rows(kv: torch.Tensor, batch: DecodeBatch, b: int) -> torch.Tensor:
    """The rows request ``b`` attends to, from kv [num_pages, page_size, kv_dim]: its context
    [kv_lens[b], kv_dim] when dense; when ``batch.token_indices`` is [B, topk] the rows of its valid
    slots [n_valid, kv_dim] (token id t is row t of kv.flatten(0, 1); -1 skipped)."""
    t = batch.token_indices
    if t is not None:
        if t.dim() != 2:
            raise ValueError(f"token_indices has shape {tuple(t.shape)}; the oracle takes one layer's "
                             f"[B, topk]: pass batch.with_slots(batch.slots(layer))")
        slots = t[b].long()
        return kv.flatten(0, 1)[slots[slots >= 0]]
    rows = kv[batch.pages_of(b).long()].reshape(-1, kv.shape[-1])
    return rows[: int(batch.kv_lens[b])]


def mla_decode(q_nope, q_pe, kv, batch: DecodeBatch, sm_scale: float, dtype=torch.float64,
               return_lse: bool = False):
    """Absorbed MLA decode.

    q_nope: [B, H, D_ckv]; q_pe: [B, H, D_kpe]
    kv:     [num_pages, page_size, D_ckv + D_kpe] real values (dequantized pool layer or source data)
    batch:  dense, or sparse with one layer's slots token_indices [B, topk] int32 (-1 = none)
    returns out [B, H, D_ckv] in ``dtype`` and, with ``return_lse``, lse [B, H] (natural log of
    sum(exp(sm_scale * score))).
    """
    d_ckv = q_nope.shape[-1]
    B, H = q_nope.shape[:2]
    out = torch.empty(B, H, d_ckv, dtype=dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=dtype, device=q_nope.device)
    q = torch.cat([q_nope, q_pe], dim=-1).to(dtype)  # [B, H, 576]
    for b in range(B):
        rows = request_rows(kv, batch, b).to(dtype)  # [L_b, 576]
        s = (q[b] @ rows.T) * sm_scale  # [H, L_b]
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :d_ckv]
    return (out, lse) if return_lse else out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf in ``out`` gives inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())
