"""FlashInfer's MLA kernels as optional peer backends (registered only when flashinfer imports).

``flashinfer_mla``      BF16 KV through ``BatchMLAPagedAttentionWrapper``; on an FP8 pool the whole
                        layer is ``.to()``-cast first, exactly what the seed's server did.
``flashinfer_mla_fp8``  FP8 KV read by FlashInfer itself (backend "fa3" on SM90, FlashInfer >= 0.6.14),
                        per-tensor ``ckv_scale`` / ``kpe_scale`` = the pool's ``k_scale``.

Planning is cached per (batch, heads, dtypes, sm_scale) so that timed calls measure ``run`` only,
as a server plans once per step and reuses the plan in every layer.
"""
from __future__ import annotations

import torch

from .backends import Backend, mark_unavailable, register

PEERS = {"flashinfer_mla": "full_pool_cast", "flashinfer_mla_fp8": "fp8_native"}

try:
    import flashinfer  # noqa: F401
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
except Exception as e:  # noqa: BLE001 - any import failure means "not here"
    for n, path in PEERS.items():
        mark_unavailable(n, path, "flashinfer", f"flashinfer does not import ({type(e).__name__}: {e}); pip install 'flashinfer-python>=0.6.14'")
    BatchMLAPagedAttentionWrapper = None

_wrappers: dict = {}


def _planned(q_nope, q_pe, batch, kv_dtype, sm_scale, backend):
    dev = q_nope.device
    B, H, d_ckv = q_nope.shape
    key = (id(batch), batch.kv_indices.data_ptr(), H, q_nope.dtype, kv_dtype, sm_scale, backend, dev)
    if key not in _wrappers:
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        w = BatchMLAPagedAttentionWrapper(ws, backend=backend)
        w.plan(
            qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev),
            kv_indptr=batch.kv_indptr.to(dev),
            kv_indices=batch.kv_indices.to(dev),
            kv_len_arr=batch.kv_lens.to(dev),
            num_heads=H, head_dim_ckv=d_ckv, head_dim_kpe=q_pe.shape[-1],
            page_size=batch.page_size, causal=False, sm_scale=sm_scale,
            q_data_type=q_nope.dtype, kv_data_type=kv_dtype,
        )
        if len(_wrappers) > 16:  # plans hold device workspaces: keep a few
            _wrappers.pop(next(iter(_wrappers)))
        _wrappers[key] = (w, batch)  # holding the batch keeps id() unique while cached
    return _wrappers[key][0]


def _bf16(q_nope, q_pe, pool, layer, batch, sm_scale):
    kv = pool.layer(layer).to(q_nope.dtype)  # the whole-pool cast (a no-op on a BF16 pool)
    k_scale = pool.scale(layer)
    w = _planned(q_nope, q_pe, batch, kv.dtype, sm_scale * k_scale, "fa3")
    d = pool.kv_lora_rank
    out = w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=kv[..., :d], kpe_cache=kv[..., d:])
    return out if k_scale == 1.0 else out * k_scale


def _fp8(q_nope, q_pe, pool, layer, batch, sm_scale):
    kv, k_scale, d = pool.layer(layer), pool.scale(layer), pool.kv_lora_rank
    w = _planned(q_nope, q_pe, batch, kv.dtype, sm_scale, "fa3")
    return w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=kv[..., :d], kpe_cache=kv[..., d:],
                 ckv_scale=k_scale, kpe_scale=k_scale)


if BatchMLAPagedAttentionWrapper is not None:
    register(Backend("flashinfer_mla", "full_pool_cast", "flashinfer", _bf16, runs_on_cpu=False,
                     min_capability=(8, 0), kernel="FlashInfer BatchMLAPagedAttentionWrapper (fa3), BF16 KV",
                     note="FP8 pool: whole-layer .to() first, as the seed's server"))
    register(Backend("flashinfer_mla_fp8", "fp8_native", "flashinfer", _fp8, kv_dtypes=("fp8_e4m3",),
                     kv_layouts=("fp8_per_tensor",),
                     runs_on_cpu=False, min_capability=(9, 0),
                     kernel="FlashInfer BatchMLAPagedAttentionWrapper (fa3), FP8 KV",
                     note="SM90 fa3; dequantizes in shared memory before BF16 WGMMA"))
