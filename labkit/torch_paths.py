"""The three decode paths in plain torch: the baseline every Triton path is swapped against.

All take (q_nope [B, H, 512], q_pe [B, H, 64], pool, layer, batch, sm_scale) and return
out [B, H, 512] in q_nope's dtype. The per-tensor FP8 scale never touches the cache: ``k_scale``
is folded into the softmax scale and ``v_scale`` (the same number: ckv is both K and V) into the
output, which leaves fp8 -> bf16 an exact widening.
"""
from __future__ import annotations

import torch

from .kvpool import DecodeBatch, KVPool


def attend_16bit(q_nope, q_pe, kv, batch: DecodeBatch, sm_scale: float, v_scale: float = 1.0):
    """BF16 attention over 16-bit pages kv [num_pages, page_size, 576], fp32 math per request."""
    B, H, d_ckv = q_nope.shape
    out = torch.empty(B, H, d_ckv, dtype=q_nope.dtype, device=q_nope.device)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    for b in range(B):
        rows = kv[batch.pages_of(b).long()].reshape(-1, kv.shape[-1])[: int(batch.kv_lens[b])]
        rows = rows.float()  # [L_b, 576]
        p = torch.softmax((q[b] @ rows.T) * sm_scale, dim=-1)
        out[b] = ((p @ rows[:, :d_ckv]) * v_scale).to(out.dtype)
    return out


def full_pool_cast(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """What the seed's server did: ``.to()`` the WHOLE layer buffer to 16 bits, then attend."""
    kv = pool.layer(layer).to(q_nope.dtype)  # [num_pages, page_size, 576]: a copy of the whole pool
    k_scale = pool.scale(layer)
    return attend_16bit(q_nope, q_pe, kv, batch, sm_scale * k_scale, k_scale)


def gather_cast(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """Gather only the batch's pages, cast those, attend over the compact copy."""
    kv = pool.layer(layer)[batch.kv_indices.long()].to(q_nope.dtype)  # [nnz, page_size, 576]
    k_scale = pool.scale(layer)
    return attend_16bit(q_nope, q_pe, kv, batch.compact(), sm_scale * k_scale, k_scale)


def fp8_native(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float,
               pages_per_tile: int = 8):
    """Read the FP8 pages a tile at a time, widen in fp32, online softmax; no 16-bit copy of KV."""
    B, H, d_ckv = q_nope.shape
    buf, k_scale = pool.layer(layer), pool.scale(layer)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    out = torch.empty(B, H, d_ckv, dtype=q_nope.dtype, device=q_nope.device)
    for b in range(B):
        pages, n = batch.pages_of(b).long(), int(batch.kv_lens[b])
        m = torch.full((H, 1), -float("inf"), device=q.device)
        l = torch.zeros(H, 1, device=q.device)
        acc = torch.zeros(H, d_ckv, device=q.device)
        for t in range(0, pages.numel(), pages_per_tile):
            tile = buf[pages[t : t + pages_per_tile]].reshape(-1, buf.shape[-1])
            tile = tile[: n - t * pool.page_size].float()  # [N, 576] unscaled
            s = (q[b] @ tile.T) * (sm_scale * k_scale)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ tile[:, :d_ckv]
            m = m_new
        out[b] = (acc / l * k_scale).to(out.dtype)
    return out
