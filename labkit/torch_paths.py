"""The three decode paths in plain torch: the baseline every Triton path is swapped against.

All take (q_nope [B, H, 512], q_pe [B, H, 64], pool, layer, batch, sm_scale) and return
out [B, H, 512] in q_nope's dtype. The per-tensor FP8 scale never touches the cache: ``k_scale``
is folded into the softmax scale and ``v_scale`` (the same number: ckv is both K and V) into the
output, which leaves fp8 -> bf16 an exact widening. ``fp8_ds_mla`` rows carry a power-of-two scale
per 128 values: e4m3 x scale is exact in BF16 too, so its casts are exact dequantizations.

Sparse (DSA) batches: ``batch.token_indices`` is this layer's [B, topk] int32 slots (global rows of
``KVPool.rows``, -1 = none, a suffix); each request attends to its valid slots only.
"""
from __future__ import annotations

import torch
from torch.profiler import record_function

from . import kvlayout
from .kvpool import DecodeBatch, KVPool


def k_scale_of(pool: KVPool, layer: int) -> float:
    """The per-tensor scale folded into sm_scale and the output; 1.0 where rows carry their own."""
    return 1.0 if pool.kv_layout == "fp8_ds_mla" else pool.scale(layer)


def widen16(stored: torch.Tensor, pool: KVPool, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., row] -> [..., 576] in ``dtype``: a widening (ds_mla: e4m3 x group scale)."""
    if pool.kv_layout == "fp8_ds_mla":
        with record_function("cast"):
            return kvlayout.dequant_ds_mla(stored, dtype)
    return stored.to(dtype)


def _valid(slots: torch.Tensor) -> torch.Tensor:
    """[topk] int32 slots of one request -> its valid token ids [n] int64."""
    return slots[slots >= 0].long()


def attend_16bit(q_nope, q_pe, kv, batch: DecodeBatch, sm_scale: float, v_scale: float = 1.0):
    """BF16 attention over 16-bit pages kv [num_pages, page_size, 576], fp32 math per request."""
    B, H, d_ckv = q_nope.shape
    out = torch.empty(B, H, d_ckv, dtype=q_nope.dtype, device=q_nope.device)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    for b in range(B):
        if batch.token_indices is not None:  # sparse: token t is row t of kv.flatten(0, 1)
            rows = kv.flatten(0, 1)[_valid(batch.token_indices[b])]
        else:
            rows = kv[batch.pages_of(b).long()].reshape(-1, kv.shape[-1])[: int(batch.kv_lens[b])]
        rows = rows.float()  # [L_b, 576]
        p = torch.softmax((q[b] @ rows.T) * sm_scale, dim=-1)
        out[b] = ((p @ rows[:, :d_ckv]) * v_scale).to(out.dtype)
    return out


def full_pool_cast(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """What the seed's server did: ``.to()`` the WHOLE layer buffer to 16 bits (ds_mla: dequantize
    it with its group scales), then attend: over the contexts, or over the slots of a sparse batch
    (the seed's server with DSA: the whole layer is still cast)."""
    kv = widen16(pool.layer(layer), pool, q_nope.dtype)  # [num_pages, page_size, 576]: a copy of the whole pool
    k_scale = k_scale_of(pool, layer)
    return attend_16bit(q_nope, q_pe, kv, batch, sm_scale * k_scale, k_scale)


def gather_cast(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """Gather only what the batch reads, cast those, attend over the compact copy: the batch's pages
    (dense) or its selected rows (sparse: topk rows per request whatever the context, a -1 slot
    gathers row 0 and is never attended)."""
    k_scale = k_scale_of(pool, layer)
    slots = batch.token_indices
    if slots is None:
        kv = widen16(pool.layer(layer)[batch.kv_indices.long()], pool, q_nope.dtype)  # [nnz, page_size, 576]
        return attend_16bit(q_nope, q_pe, kv, batch.compact(), sm_scale * k_scale, k_scale)
    B, topk = slots.shape
    rows = pool.rows(layer)[slots.flatten().clamp_min(0).long()]  # [B * topk, row] as stored
    kv = widen16(rows, pool, q_nope.dtype)[:, None]  # [B * topk, 1, 576]: one-token pages
    own = torch.arange(B * topk, dtype=torch.int32, device=slots.device).view(B, topk)
    compact = batch.with_slots(torch.where(slots >= 0, own, -1))  # slot j of request b is row b * topk + j
    return attend_16bit(q_nope, q_pe, kv, compact, sm_scale * k_scale, k_scale)


def _tiles(pool: KVPool, layer: int, batch: DecodeBatch, b: int, pages_per_tile: int, slots_per_tile: int):
    """Request ``b``'s rows as stored, a tile [N, row] at a time: its pages, or its valid slots."""
    if batch.token_indices is not None:
        ids, rows = _valid(batch.token_indices[b]), pool.rows(layer)
        for t in range(0, ids.numel(), slots_per_tile):
            yield rows[ids[t : t + slots_per_tile]]
        return
    buf, pages, n = pool.layer(layer), batch.pages_of(b).long(), int(batch.kv_lens[b])
    for t in range(0, pages.numel(), pages_per_tile):
        yield buf[pages[t : t + pages_per_tile]].reshape(-1, buf.shape[-1])[: n - t * pool.page_size]


def fp8_native(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float,
               pages_per_tile: int = 8, slots_per_tile: int = 256):
    """Read the FP8 rows a tile at a time (the pages, or the selected slots of a sparse batch), widen
    in fp32 (ds_mla: times its group scales), online softmax; no 16-bit copy of KV."""
    B, H, d_ckv = q_nope.shape
    k_scale = k_scale_of(pool, layer)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    out = torch.empty(B, H, d_ckv, dtype=q_nope.dtype, device=q_nope.device)
    for b in range(B):
        m = torch.full((H, 1), -float("inf"), device=q.device)
        l = torch.zeros(H, 1, device=q.device)
        acc = torch.zeros(H, d_ckv, device=q.device)
        for tile in _tiles(pool, layer, batch, b, pages_per_tile, slots_per_tile):
            # [N, 576] fp32: codes (per-tensor: k_scale folded below) or real values (ds_mla)
            tile = kvlayout.dequant_ds_mla(tile) if pool.kv_layout == "fp8_ds_mla" else tile.float()
            s = (q[b] @ tile.T) * (sm_scale * k_scale)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ tile[:, :d_ckv]
            m = m_new
        out[b] = (acc / l * k_scale).to(out.dtype)
    return out
