"""The decode paths with Triton kernels, registered as backends ``<path>.triton`` (and the seed's).

    full_pool_cast.triton  Triton whole-layer FP8 -> BF16 cast (``fp8_to_bf16``; ``ds_mla_to_bf16`` for
                           the 656-byte rows), then Triton ``mla_decode``
    full_pool_cast.seed    torch ``.to()`` of the whole layer (ds_mla: torch dequantization), then Triton
                           ``mla_decode``: the seed's server (with DSA when the batch is sparse)
    gather_cast.triton     fused gather + cast of the batch's pages (sparse: of its selected token rows),
                           ``mla_decode`` on the compact table
    fp8_native.triton      ``mla_decode_fp8(q_fp8=False)``: FP8 pages read directly, no 16-bit copy of
                           KV, 16-bit query: the same numbers as the cast paths (~1e-3 rel. error)
    fp8_native.triton_q8   ``mla_decode_fp8`` as it defaults: query in FP8 too (the trtllm_mla way),
                           2.5-2.6e-2 relative error (H200, run 6)
    fp8_native.gluon       ``mla_decode_fp8_gluon``: TMA ring (cp.async rows for sparse slots), both
                           products as FP8 wgmma (V^T a register operand, p in e4m3): no 16-bit copy of V
                           anywhere; 2.7-2.9e-2 relative error; Hopper (sm_90) only, no CPU interpreter;
                           dense pages of 64/128, sparse any; 1-128 heads; per-tensor layout. Dense
                           at 65-128 heads with long splits (fast), the plan launches ``mla_decode_fp8_ws``
    fp8_native.gluon_acc   the same, precision="accurate": q and p each as two e4m3 terms and splits of at
                           most 4096 tokens (the FP8 MMA's narrow accumulator): 2.0-2.6e-3
    bf16_pool.triton       ``mla_decode`` on a BF16 pool; refuses FP8 (the refusal demo)

Scales: real KV = stored * k_scale; k_scale is folded into the softmax scale and v_scale (= k_scale:
ckv is both K and V) into the output, so the casts are exact widenings of the stored values.
``fp8_ds_mla`` rows are dequantized with their power-of-two group scales (exact in BF16): k_scale = 1.
Sparse batches (the four 16-bit paths): ``mla_decode`` runs them as a table of one-token pages whose
kv_indices are the slots; the valid counts are summed on the device (the -1s are a suffix).
Imported by ``labkit.backends._load_optional``.
"""
from __future__ import annotations

import torch

from labkit.backends import ALL_LAYOUTS, ALL_PAGE_SIZES, Backend, register
from labkit.kernels.ds_mla_to_bf16 import ds_mla_to_bf16
from labkit.kernels.fp8_to_bf16 import fp8_to_bf16
from labkit.kernels.gather_cast import gather_cast
from labkit.kernels.mla_decode import mla_decode
from labkit.kernels.mla_decode_fp8 import mla_decode_fp8
from labkit.kernels.mla_decode_fp8_gluon import MAX_HEADS as GLUON_MAX_HEADS, mla_decode_fp8_gluon

from . import triton_plans
from .kvpool import DecodeBatch, KVPool
from .torch_paths import k_scale_of, widen16

FP8_SM = (8, 9)  # Triton's float8e4nv needs sm_89+ (Ada, Hopper, Blackwell)
TMA_SM = (9, 0)  # tensor-memory-access descriptors and wgmma: Hopper and later
BF16_SM = (8, 0)  # bf16 tensor cores


def _decode16(q_nope, q_pe, kv, batch: DecodeBatch, sm_scale: float, k_scale: float):
    """``mla_decode`` over 16-bit kv [num_pages, page_size, 576]. A sparse batch (token_indices
    [B, topk] int32, -1 a suffix) runs as one-token pages: token t is row t of kv.flatten(0, 1)."""
    slots = batch.token_indices
    if slots is None:
        return mla_decode(q_nope, q_pe, kv, batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                          sm_scale * k_scale, v_scale=k_scale, max_len=batch.max_len)
    B, topk = slots.shape
    kv_indptr = torch.arange(0, (B + 1) * topk, topk, dtype=torch.int32, device=slots.device)
    kv_lens = (slots >= 0).sum(-1, dtype=torch.int32)  # valid slots, counted on the device
    return mla_decode(q_nope, q_pe, kv.flatten(0, 1)[:, None], kv_indptr, slots.flatten(), kv_lens,
                      sm_scale * k_scale, v_scale=k_scale, max_len=min(topk, batch.max_len))


def full_pool_cast_triton(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """Cast the WHOLE layer with a Triton cast kernel (P * 3 B moved; ds_mla P * (656 + 1152) B), then
    attend over it (dense, or the slots of a sparse batch)."""
    buf = pool.layer(layer)
    if pool.kv_layout == "fp8_ds_mla":
        kv = ds_mla_to_bf16(buf)  # [num_pages, page_size, 576] bf16, group scales applied
    else:
        kv = fp8_to_bf16(buf) if buf.dtype == torch.float8_e4m3fn else buf
    return _decode16(q_nope, q_pe, kv.to(q_nope.dtype), batch, sm_scale, k_scale_of(pool, layer))


def full_pool_cast_seed(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """The seed's server: ``get_key_buffer(layer).to(q.dtype)`` (torch, whole layer; ds_mla: torch
    dequantization), then attend (dense, or the slots of a sparse batch: the seed's server with DSA)."""
    kv = widen16(pool.layer(layer), pool, q_nope.dtype)
    return _decode16(q_nope, q_pe, kv, batch, sm_scale, k_scale_of(pool, layer))


def _gather16(pool: KVPool, layer: int, batch: DecodeBatch) -> torch.Tensor:
    """What the batch reads, gathered and cast in one Triton pass (a copy for a BF16 pool): its pages
    [nnz, page_size, 576] when dense; its slots' rows as one-token pages [B * topk, 1, 576] when sparse
    (topk per request whatever the context; a -1 slot gives a zero row)."""
    slots = batch.token_indices
    src, idx = (pool.layer(layer), batch.kv_indices) if slots is None else (pool.rows(layer)[:, None], slots.flatten())
    if pool.kv_layout == "fp8_ds_mla":
        return ds_mla_to_bf16(src, idx)
    if pool.kv_layout == "fp8_per_tensor":
        return gather_cast(src, idx)
    return src[idx.long().clamp_min(0)]


def gather_cast_triton(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """Gather and cast only what the batch reads (its pages, or its selected rows), attend over the
    compact copy."""
    kv = _gather16(pool, layer, batch).to(q_nope.dtype)
    slots = batch.token_indices
    if slots is None:
        compact = batch.compact()
    else:  # slot j of request b is row b * topk + j of the copy
        own = torch.arange(slots.numel(), dtype=torch.int32, device=slots.device).view(slots.shape)
        compact = batch.with_slots(torch.where(slots >= 0, own, -1))
    return _decode16(q_nope, q_pe, kv, compact, sm_scale, k_scale_of(pool, layer))


def fp8_native_triton(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """FP8 pages straight into the decode kernel, widened in registers; 16-bit query."""
    return mla_decode_fp8(q_nope, q_pe, pool.layer(layer), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                          sm_scale, k_scale=pool.scale(layer), q_fp8=False, max_len=batch.max_len)


def fp8_native_triton_q8(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """FP8 pages and an FP8 query (one scale per request and head block): FP8 dots for the scores."""
    return mla_decode_fp8(q_nope, q_pe, pool.layer(layer), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                          sm_scale, k_scale=pool.scale(layer), q_fp8=True, max_len=batch.max_len)


def _fp8_gluon(precision: str):
    def fp8_native_gluon(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
        """FP8 pages by TMA (rows by cp.async when sparse), q and p in e4m3 (one or two terms each):
        both products on FP8 tensor cores."""
        ds = pool.kv_layout == "fp8_ds_mla"
        return mla_decode_fp8_gluon(q_nope, q_pe, pool.layer(layer), batch.kv_indptr, batch.kv_indices,
                                    batch.kv_lens, sm_scale, k_scale=1.0 if ds else pool.scale(layer),
                                    max_len=batch.max_len, token_indices=batch.token_indices, precision=precision,
                                    kv_layout=pool.kv_layout)
    return fp8_native_gluon


def bf16_pool_triton(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
    """The 16-bit kernel on a pool already in BF16 (dense or sparse); FP8 pages are refused by
    mla_decode itself."""
    return _decode16(q_nope, q_pe, pool.layer(layer), batch, sm_scale, pool.scale(layer))


register(Backend("full_pool_cast.triton", "full_pool_cast", "triton", full_pool_cast_triton,
                 planner=triton_plans.full_pool_cast(triton_plans.widen_triton),
                 kv_layouts=ALL_LAYOUTS, sparse=True,
                 min_capability=FP8_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="Triton fp8_to_bf16 or ds_mla_to_bf16 (whole layer) + Triton mla_decode",
                 note="casts the whole layer each call: P*(1+2) B before attention (ds_mla: P*(656+1152) B)"))
register(Backend("full_pool_cast.seed", "full_pool_cast", "seed", full_pool_cast_seed,
                 planner=triton_plans.full_pool_cast(triton_plans.widen_torch),
                 kv_layouts=ALL_LAYOUTS, sparse=True,
                 min_capability=BF16_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="torch .to() (whole layer) + Triton mla_decode",
                 note="exactly the seed's server: get_key_buffer(layer).to(q.dtype)"))
register(Backend("gather_cast.triton", "gather_cast", "triton", gather_cast_triton,
                 planner=triton_plans.gather_cast_plan,
                 kv_layouts=ALL_LAYOUTS, sparse=True,
                 min_capability=FP8_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="Triton gather_cast or ds_mla_to_bf16 (batch pages, or slot rows) + Triton mla_decode "
                        "on the compact table"))
register(Backend("fp8_native.triton", "fp8_native", "triton", fp8_native_triton,
                 planner=triton_plans.fp8_native(False), kv_dtypes=("fp8_e4m3",),
                 kv_layouts=("fp8_per_tensor",),
                 min_capability=FP8_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="Triton mla_decode_fp8: FP8 tiles widened in registers",
                 note="k_scale folded into the softmax scale, v_scale into the output"))
register(Backend("fp8_native.triton_q8", "fp8_native", "triton_q8", fp8_native_triton_q8,
                 planner=triton_plans.fp8_native(True), kv_dtypes=("fp8_e4m3",),
                 kv_layouts=("fp8_per_tensor",), precision="fast",
                 min_capability=FP8_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="Triton mla_decode_fp8, q in FP8, FP8 dots for the scores (trtllm_mla's way)",
                 note="FP8 query: 2.5-2.6e-2 relative error (H200, run 6) against 1.7e-3 with a 16-bit "
                      "query; the fastest dense kernel of ours at 64-128 heads there"))
# gluon_acc: at most ACCURATE_SPLIT_LEN tokens a split keeps it within the accurate rule at every head
# count (8192-token splits gave 3.7e-3 at 128 heads, 64 x 8K; 4096-token ones 2.2-2.6e-3)
for _name, _prec, _how in (
        ("gluon", "fast", "q and p in e4m3: 2.7-2.9e-2 relative error (H200)"),
        ("gluon_acc", "accurate", "q and p each as two e4m3 terms (twice the MMAs), splits of at most 4096 "
                                  "tokens: 2.0-2.6e-3 (H200)")):
    register(Backend(f"fp8_native.{_name}", "fp8_native", _name, _fp8_gluon(_prec),
                     planner=triton_plans.gluon(_prec), kv_dtypes=("fp8_e4m3",),
                     kv_layouts=("fp8_per_tensor", "fp8_ds_mla"), dense_layouts=("fp8_per_tensor",),
                     precision=_prec, sparse=True,
                     min_capability=TMA_SM, max_capability=TMA_SM, page_sizes=(64, 128),
                     sparse_page_sizes=ALL_PAGE_SIZES, max_heads=GLUON_MAX_HEADS, runs_on_cpu=False,
                     kernel="Gluon mla_decode_fp8_gluon: TMA ring (cp.async rows when sparse), FP8 wgmma "
                            "for q.K and p.V",
                     note=f"V^T is a register operand (no 16-bit copy of V); {_how}"))
register(Backend("bf16_pool.triton", "bf16_pool", "triton", bf16_pool_triton,
                 planner=triton_plans.bf16_pool, kv_dtypes=("bf16",), kv_layouts=("bf16",),
                 sparse=True, min_capability=BF16_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                 kernel="Triton mla_decode, 16-bit KV only",
                 note="refuses FP8 KV like FlashInfer's static_assert(sizeof(DType) == 2)"))


# FP8 rows by id (dense page table or sparse top-k slots), both FP8 row layouts, both precisions
from labkit.kernels.mla_decode_fp8_rows import mla_decode_fp8_rows  # noqa: E402


def _fp8_rows(precision: str):
    def run(q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float):
        """Token rows of ``pool.rows(layer)`` by page table (dense) or ``batch.token_indices`` (sparse)."""
        ds = pool.kv_layout == "fp8_ds_mla"
        common = dict(sm_scale=sm_scale, kv_layout=pool.kv_layout, k_scale=1.0 if ds else pool.scale(layer),
                      precision=precision)
        if batch.token_indices is not None:
            return mla_decode_fp8_rows(q_nope, q_pe, pool.rows(layer), token_indices=batch.token_indices, **common)
        return mla_decode_fp8_rows(q_nope, q_pe, pool.rows(layer), kv_indptr=batch.kv_indptr,
                                   kv_indices=batch.kv_indices, kv_lens=batch.kv_lens, page_size=pool.page_size,
                                   max_len=batch.max_len, **common)
    return run


for _name, _prec, _how in (("triton_rows", "fast", "e4m3 query, FP8 score dots, V widened to fp16 for P.V"),
                           ("triton_rows_acc", "accurate", "query as hi + lo e4m3 terms (two FP8 score dots), "
                                                           "V widened to fp16 for P.V")):
    register(Backend(f"fp8_native.{_name}", "fp8_native", _name, _fp8_rows(_prec),
                     planner=triton_plans.fp8_rows(_prec), kv_dtypes=("fp8_e4m3",),
                     kv_layouts=("fp8_per_tensor", "fp8_ds_mla"), precision=_prec, dense=True, sparse=True,
                     # fp8_ds_mla widens K/V to bf16 and keeps the query bf16: 2.0e-3 on the H200 (run 11)
                     layout_precision=(("fp8_ds_mla", "accurate"),),
                     min_capability=FP8_SM, page_sizes=ALL_PAGE_SIZES, max_heads=128, runs_on_cpu=True,
                     kernel=f"Triton mla_decode_fp8_rows: rows by id, {_how}",
                     note="fp8_ds_mla: each token's 4 power-of-two scales multiplied in while K/V widen to "
                          "bf16 (exact), bf16 dots (ds_scales='groups': the FP8 dots with per-group scaling)"))
