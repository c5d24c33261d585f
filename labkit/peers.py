"""FlashInfer's MLA kernels as optional peer backends (registered only when flashinfer imports).

``flashinfer_mla``      BF16 KV through ``BatchMLAPagedAttentionWrapper`` (backend "fa3"); on an FP8
                        pool the whole layer is ``.to()``-cast first, exactly what the seed's server did.
``flashinfer_mla_fp8``  FP8 KV read by FlashInfer itself (FlashInfer >= 0.6.14 on SM90), per-tensor
                        ``ckv_scale`` / ``kpe_scale`` = the pool's ``k_scale``.

Both take dense batches (the pool's pages) and sparse ones: a sparse batch runs as page size 1 over
the layer viewed as [pool_tokens, 1, 576], ``kv_indices`` = each request's valid slots and
``kv_indptr`` from their counts. The counts are fixed when the batch is planned (they are
min(context, topk) for an indexer's slots, in every layer); each layer copies its slots into the
planned ``kv_indices`` buffer on the device (after a stable sort that moves -1s last, unless the
planned slots came valid-first, as an indexer gives them).

Planning happens once per batch (``Backend.planner``): FlashInfer's plan copies metadata to the
host, so it must never run inside a CUDA graph. Every layer's ``run`` launches device work only:
a BF16 plan holds ``sm_scale`` alone and a layer's ``k_scale`` scales the query and the output.
"""
from __future__ import annotations

import torch

from .backends import Backend, mark_unavailable, register

PEERS = {"flashinfer_mla": "full_pool_cast", "flashinfer_mla_fp8": "fp8_native"}
WORKSPACE_BYTES = 128 << 20  # FlashInfer's usual float workspace

try:
    import flashinfer  # noqa: F401
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
except Exception as e:  # noqa: BLE001 - any import failure means "not here"
    for n, path in PEERS.items():
        mark_unavailable(n, path, "flashinfer", f"flashinfer does not import ({type(e).__name__}: {e}); "
                                                f"pip install 'flashinfer-python>=0.6.14'")
    BatchMLAPagedAttentionWrapper = None

_workspaces: dict = {}


def _workspace(device) -> torch.Tensor:
    """One float workspace per device, shared by every plan: runs on one stream never overlap."""
    key = str(device)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[key]


def slot_counts(slots: torch.Tensor) -> list[int]:
    """Valid (>= 0) slots per request of one layer's ``slots`` [B, topk] int32 (a host read)."""
    return (slots >= 0).sum(-1).tolist()


def slot_gather_index(slots: torch.Tensor) -> torch.Tensor:
    """int64 [n_valid] positions into ``slots.flatten()`` of the valid slots, request by request
    (the order FlashInfer's ``kv_indices`` wants); computed once per batch."""
    return torch.nonzero(slots.flatten() >= 0).flatten()


def _plan(pool, batch, num_heads, sm_scale, q_dtype, kv_dtype):
    """A planned wrapper and, for a sparse batch, the kv_indices buffer, the gather index it reads and
    whether the slots come valid-first (the indexer's order: no per-layer sort)."""
    dev = pool.device
    B = batch.batch_size
    w = BatchMLAPagedAttentionWrapper(_workspace(dev), backend="fa3")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
    if batch.topk:
        packed = valid_first(batch.token_indices)
        slots = batch.slots(0)
        if not packed:
            slots = slots.gather(1, torch.sort((slots < 0).to(torch.int8), dim=1, stable=True).indices)
        counts = torch.tensor(slot_counts(slots), dtype=torch.int32)
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(counts, 0)
        gather = slot_gather_index(slots)
        kv_indices = slots.flatten()[gather].contiguous()  # layer 0's slots; each run refills it
        kv_indptr, kv_lens, page_size = kv_indptr.to(dev), counts.to(dev), 1
    else:
        packed, gather, kv_indptr, kv_indices, kv_lens, page_size = (True, None, batch.kv_indptr, batch.kv_indices,
                                                                     batch.kv_lens, pool.page_size)
    w.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_lens,
           num_heads=num_heads, head_dim_ckv=pool.kv_lora_rank, head_dim_kpe=pool.kv_dim - pool.kv_lora_rank,
           page_size=page_size, causal=False, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
    return w, kv_indices, gather, packed


def _layer_kv(pool, layer: int, batch) -> torch.Tensor:
    """The layer as FlashInfer reads it: [num_pages, page_size, 576], or [pool_tokens, 1, 576] when sparse."""
    return pool.rows(layer)[:, None, :] if batch.topk else pool.layer(layer)


def valid_first(slots: torch.Tensor) -> bool:
    """Whether every request's -1 slots come after its valid ones in ``slots`` [..., topk] (a host read)."""
    valid = (slots >= 0).to(torch.int8)
    return bool((valid[..., 1:] <= valid[..., :-1]).all()) if slots.shape[-1] > 1 else True


def _set_slots(kv_indices, gather, batch, packed: bool) -> None:
    """This layer's valid slots into the planned kv_indices buffer: device work only, capturable.
    Unless the batch's slots were valid-first when planned, a stable sort moves the -1s last first."""
    if gather is None:
        return
    slots = batch.token_indices
    if not packed:
        slots = slots.gather(1, torch.sort((slots < 0).to(torch.int8), dim=1, stable=True).indices)
    torch.index_select(slots.flatten(), 0, gather, out=kv_indices)


def _bf16_planner(pool, batch, num_heads, sm_scale, q_dtype):
    w, kv_indices, gather, packed = _plan(pool, batch, num_heads, sm_scale, q_dtype, q_dtype)
    d = pool.kv_lora_rank

    def run(q_nope, q_pe, layer, batch_l):
        _set_slots(kv_indices, gather, batch_l, packed)
        kv = _layer_kv(pool, layer, batch_l).to(q_nope.dtype)  # the whole-layer cast (no-op on BF16)
        k_scale = pool.scale(layer)
        if k_scale != 1.0:  # scores and values both carry k_scale: scale q in, the output out
            q_nope, q_pe = q_nope * k_scale, q_pe * k_scale
        out = w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=kv[..., :d], kpe_cache=kv[..., d:])
        return out if k_scale == 1.0 else out * k_scale

    return run


def _fp8_planner(pool, batch, num_heads, sm_scale, q_dtype):
    w, kv_indices, gather, packed = _plan(pool, batch, num_heads, sm_scale, q_dtype, torch.float8_e4m3fn)
    d = pool.kv_lora_rank

    def run(q_nope, q_pe, layer, batch_l):
        _set_slots(kv_indices, gather, batch_l, packed)
        kv, k_scale = _layer_kv(pool, layer, batch_l), pool.scale(layer)
        return w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=kv[..., :d], kpe_cache=kv[..., d:],
                     ckv_scale=k_scale, kpe_scale=k_scale)

    return run


def _through_plan(name):
    """``Backend.fn`` for a planned peer: the cached plan's run (fn's signature, for direct callers)."""
    def fn(q_nope, q_pe, pool, layer, batch, sm_scale):
        from .backends import REGISTRY

        plan = REGISTRY[name].plan(pool, batch, q_nope.shape[1], sm_scale, q_nope.dtype)
        return plan._run(q_nope, q_pe, layer, batch)
    return fn


if BatchMLAPagedAttentionWrapper is not None:
    register(Backend("flashinfer_mla", "full_pool_cast", "flashinfer", _through_plan("flashinfer_mla"),
                     runs_on_cpu=False, min_capability=(8, 0), sparse=True, planner=_bf16_planner,
                     kernel="FlashInfer BatchMLAPagedAttentionWrapper (fa3), BF16 KV",
                     note="FP8 pool: whole-layer .to() first, as the seed's server; sparse: page size 1"))
    register(Backend("flashinfer_mla_fp8", "fp8_native", "flashinfer", _through_plan("flashinfer_mla_fp8"),
                     kv_dtypes=("fp8_e4m3",), kv_layouts=("fp8_per_tensor",), sparse=True, planner=_fp8_planner,
                     runs_on_cpu=False, min_capability=(9, 0),
                     kernel="FlashInfer BatchMLAPagedAttentionWrapper (fa3), FP8 KV",
                     note="SM90 fa3; dequantizes in shared memory before BF16 WGMMA; sparse: page size 1"))
