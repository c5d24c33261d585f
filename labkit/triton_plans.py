"""Per-batch plans of the Triton paths (``Backend.planner``): a layer's call is launches only.

What a batch fixes is computed once here: the kernel config, the split count (from the host
lengths: no device read), the stage-1 partials and the merge (``labkit.kernels.launch.SplitKV``),
each layer's view and ``k_scale`` (host floats), the compact page table of ``gather_cast``. Each
layer's ``run`` then allocates its output and launches the same kernels with the same arguments
as the checked launchers (``mla_decode``, ``mla_decode_fp8``): equal outputs, less host time,
nothing a CUDA graph cannot capture. A planner returns None (the backend's ``fn`` runs) for what it does not plan:
sparse batches and the ``fp8_ds_mla`` layout, except ``RowsPlan`` (the rows kernels), which plans both.
"""
from __future__ import annotations

import torch
import triton

from labkit.kernels import fp8_to_bf16 as cast_k
from labkit.kernels import gather_cast as gather_k
from labkit.kernels.fp8_to_bf16 import fp8_to_bf16
from labkit.kernels.launch import Launcher, SplitKV
from labkit.kernels.mla_decode import LOG2E, _mla_decode_kernel, pick_block_h, resolve_splits
from labkit.kernels.mla_decode_fp8 import _mla_decode_fp8_kernel, default_config, quantize_q_fp8
from labkit.kernels import mla_decode_fp8_gluon as G
from labkit.kernels import mla_decode_fp8_rows as R
from labkit.kernels import mla_decode_fp8_ws as W

from .kvpool import DecodeBatch, KVPool


def _plannable(pool: KVPool, batch: DecodeBatch) -> bool:
    return not batch.topk and pool.kv_layout != "fp8_ds_mla"


def _layers(pool: KVPool):
    """Each layer's [num_pages, page_size, 576] view and per-tensor k_scale, read once."""
    return [pool.layer(i) for i in range(pool.num_layers)], [float(s) for s in pool.k_scale.tolist()]


class Decode16:
    """``mla_decode`` (16-bit KV) planned for one batch; k_scale folded as the launcher's callers do."""

    def __init__(self, batch: DecodeBatch, heads: int, sm_scale: float, q_dtype, device, page_size: int):
        on_gpu = torch.device(device).type == "cuda"
        self.block_h = pick_block_h(heads, None)
        big = self.block_h >= 64  # mla_decode's defaults per head class
        self.block_n = (64 if big else 32) if on_gpu else 128
        self.num_warps, self.num_stages = (8, 2) if big else (4, 3)
        self.f32_math = not on_gpu
        self.batch, self.sm_scale = batch, float(sm_scale)
        hb = triton.cdiv(heads, self.block_h)
        s = resolve_splits("mla_decode", None, batch.batch_size, hb, batch.kv_lens, batch.max_len,
                           self.block_n, torch.device(device), ctas_per_sm=2 if big else 4)
        self.grid = (batch.batch_size, hb, s)
        self.split = SplitKV.make(batch.batch_size, heads, s, q_dtype, device)
        self.kernel = Launcher(_mla_decode_kernel, self.grid, PAGE=page_size, BLOCK_N=self.block_n,
                               BLOCK_H=self.block_h, DIRECT=self.split.direct, F32_MATH=self.f32_math,
                               num_warps=self.num_warps, num_stages=self.num_stages)

    def __call__(self, q_nope, q_pe, kv, k_scale: float):
        """kv [pages, page_size, 576] 16-bit, real = kv * k_scale -> out [B, H, 512]."""
        b, heads = self.batch, q_nope.shape[1]

        def stage1(o_buf, lse_buf, direct):
            self.kernel(q_nope, q_pe, kv, b.kv_indptr, b.kv_indices, b.kv_lens, o_buf, lse_buf,
                        self.sm_scale * k_scale * LOG2E, float(k_scale), heads, self.grid[2],
                        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
                        o_buf.stride(0), o_buf.stride(1))

        return self.split.run(stage1, k_scale)


def bf16_pool(pool, batch, num_heads, sm_scale, q_dtype):
    if not _plannable(pool, batch):
        return None
    views, scales = _layers(pool)
    dec = Decode16(batch, num_heads, sm_scale, q_dtype, pool.device, pool.page_size)
    return lambda q_nope, q_pe, layer, _b: dec(q_nope, q_pe, views[layer], scales[layer])


def full_pool_cast(widen):
    """Planner of a whole-layer cast (``widen(layer_view, q_dtype)``) then ``mla_decode``."""
    def planner(pool, batch, num_heads, sm_scale, q_dtype):
        if not _plannable(pool, batch):
            return None
        views, scales = _layers(pool)
        dec = Decode16(batch, num_heads, sm_scale, q_dtype, pool.device, pool.page_size)
        w = widen
        if widen is widen_triton and views[0].dtype == torch.float8_e4m3fn:
            cast = Cast(views[0].shape)
            w = lambda kv, dtype: cast(kv).to(dtype)  # noqa: E731
        return lambda q_nope, q_pe, layer, _b: dec(q_nope, q_pe, w(views[layer], q_nope.dtype), scales[layer])
    return planner


class Cast:
    """``fp8_to_bf16`` planned for one layer's shape: kv [pages, page_size, 576] e4m3 -> a new bf16 tensor."""

    def __init__(self, shape):
        self.shape, self.n = tuple(shape), 1
        for d in shape:
            self.n *= d
        grid, meta = cast_k.launch_config(self.n)
        self.kernel = Launcher(cast_k._fp8_to_bf16_kernel, grid, **meta)

    def __call__(self, kv):
        y = torch.empty(self.shape, dtype=torch.bfloat16, device=kv.device)
        self.kernel(kv, y, self.n)
        return y


def widen_triton(kv, dtype):
    return (fp8_to_bf16(kv) if kv.dtype == torch.float8_e4m3fn else kv).to(dtype)


def widen_torch(kv, dtype):
    return kv.to(dtype)


def gather_cast_plan(pool, batch, num_heads, sm_scale, q_dtype):
    """The batch's pages gathered and widened per layer, attended over the compact table (planned once)."""
    if not _plannable(pool, batch):
        return None
    views, scales = _layers(pool)
    compact = batch.compact()
    pages = batch.kv_indices.long()
    dec = Decode16(compact, num_heads, sm_scale, q_dtype, pool.device, pool.page_size)
    nnz, (page, d) = batch.kv_indices.numel(), views[0].shape[1:]
    grid, meta = gather_k.launch_config(nnz, page * d)
    gather = Launcher(gather_k._gather_cast_kernel, grid, **meta)
    idx = batch.kv_indices.contiguous()

    def run(q_nope, q_pe, layer, _b):
        buf = views[layer]
        if buf.dtype == torch.float8_e4m3fn and nnz:
            kv = torch.empty(nnz, page, d, dtype=torch.bfloat16, device=buf.device)
            gather(buf, idx, kv, nnz, buf.stride(0))
        else:
            kv = buf[pages]
        return dec(q_nope, q_pe, kv.to(q_nope.dtype), scales[layer])
    return run


def fp8_native(q_fp8: bool):
    """Planner of ``mla_decode_fp8`` with a 16-bit (False) or FP8 (True) query, its default config."""
    def planner(pool, batch, num_heads, sm_scale, q_dtype):
        if not _plannable(pool, batch):
            return None
        views, scales = _layers(pool)
        dev = pool.device
        on_gpu = dev.type == "cuda"
        cfg = default_config(num_heads, on_gpu, q_fp8)
        cfg.setdefault("ctas_per_sm", 2)
        block_h = pick_block_h(num_heads, None)
        hb = triton.cdiv(num_heads, block_h)
        s = resolve_splits("mla_decode_fp8", None, batch.batch_size, hb, batch.kv_lens, batch.max_len,
                           cfg["block_n"], dev, cfg["ctas_per_sm"])
        split = SplitKV.make(batch.batch_size, num_heads, s, q_dtype, dev)
        q_mode = (1 if not on_gpu else 2) if cfg["q_fp8"] else 0
        b = batch
        kernel = Launcher(_mla_decode_fp8_kernel, (b.batch_size, hb, s), PAGE=pool.page_size, BLOCK_N=cfg["block_n"],
                          BLOCK_H=block_h, DIRECT=split.direct, F32=not on_gpu, Q_FP8=q_mode, SWAP=int(cfg["swap"]),
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

        def run(q_nope, q_pe, layer, _b):
            kv, k_scale = views[layer], scales[layer]
            qn, qp, q_scale = (*quantize_q_fp8(q_nope, q_pe, block_h),) if q_mode == 1 else (q_nope, q_pe, None)

            def stage1(o_buf, lse_buf, direct):
                kernel(qn, qp, kv, b.kv_indptr, b.kv_indices, b.kv_lens, o_buf, lse_buf,
                       q_scale if q_scale is not None else lse_buf, float(sm_scale) * k_scale * LOG2E, k_scale,
                       num_heads, s, qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), kv.stride(0),
                       o_buf.stride(0), o_buf.stride(1))

            return split.run(stage1, k_scale)
        return run
    return planner


def gluon(precision: str):
    """The planner of ``mla_decode_fp8_gluon`` at ``precision``."""
    return lambda pool, batch, num_heads, sm_scale, q_dtype: _gluon(pool, batch, num_heads, sm_scale, q_dtype,
                                                                    precision)


def _gluon(pool, batch, num_heads, sm_scale, q_dtype, precision):
    """``mla_decode_fp8_gluon`` planned: its rules checked once, then the same kernel launched with
    the launcher's arguments and defaults (``GPU_CONFIG``), partials and merge from ``SplitKV``.
    fp8_ds_mla (sparse only): the rows' e4m3, fp32 and bf16 views (``rows_views``), k_scale 1."""
    sparse = bool(batch.topk)
    ds = G.check_ds_args(pool.kv_buffer[0], pool.kv_layout, sparse, 1.0, None)
    G.check_gluon_args(num_heads, pool.page_size, pool.device, sparse)
    views = [R.rows_views(pool.layer(i), pool.kv_layout) for i in range(pool.num_layers)]  # e4m3, fp32, bf16
    scales = [1.0] * pool.num_layers if ds else _layers(pool)[1]
    block_h, num_warps, cfg = G.block_config(num_heads, precision=precision, sparse=sparse, ds=ds)
    cfg = G.split_rule(cfg, precision)
    head_blocks = -(-num_heads // block_h)
    s = resolve_splits("mla_decode_fp8_gluon", None, batch.batch_size, head_blocks, batch.kv_lens,
                       batch.topk if sparse else batch.max_len, G.BLOCK_N, pool.device, cfg["ctas_per_sm"],
                       cfg["min_tiles"], cfg["max_splits"])
    s = G.capped_splits(s, batch.topk if sparse else batch.max_len, precision)
    split = SplitKV.make(batch.batch_size, num_heads, s, q_dtype, pool.device, G.part_dtype_for(precision))
    num_rows = pool.num_pages * pool.page_size
    b = batch
    if W.preferred(num_heads, pool.kv_layout, sparse, precision,
                   W.split_len(batch.batch_size, num_heads, batch.topk if sparse else batch.max_len, pool.device)):
        return _gluon_ws(pool, b, num_heads, sm_scale, split, head_blocks)
    kernel = Launcher(G._mla_decode_fp8_gluon_kernel, (head_blocks, b.batch_size, s), PAGE=pool.page_size,
                      BLOCK_H=block_h, DIRECT=split.direct, NUM_STAGES=cfg["num_stages"], NUM_WARPS=num_warps,
                      SPARSE=sparse, SPLIT=precision == "accurate", DS=ds,
                      PIPE=G.use_pipeline(cfg, block_h, sparse, ds, precision),
                      SLOT_RING=G.use_slot_ring(sparse, ds, num_warps, precision=precision), num_warps=num_warps)

    def run(q_nope, q_pe, layer, b_layer):
        (kv, kv32, kv16), k_scale = views[layer], scales[layer]
        tok = b_layer.token_indices if sparse else b.kv_lens  # this layer's [B, topk] slots

        def stage1(o_buf, lse_buf, direct):
            triton.set_allocator(G._scratch)  # the kernel's TMA descriptors live in Triton-allocated scratch
            kernel(q_nope, q_pe, kv, kv16, kv32, num_rows, b.kv_indptr, b.kv_indices, b.kv_lens, tok, b.topk,
                   o_buf, lse_buf, float(sm_scale) * k_scale * LOG2E, k_scale, num_heads, s, q_nope.stride(0),
                   q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1))

        return split.run(stage1, k_scale)
    return run


def _gluon_ws(pool, b, num_heads, sm_scale, split, head_blocks):
    """``mla_decode_fp8_ws`` (fast, 65-128 heads, ``W.preferred``) planned: as ``_gluon``, its own kernel."""
    kvs, scales = _layers(pool)
    s, num_rows, sparse = split.num_splits, pool.num_pages * pool.page_size, bool(b.topk)
    kernel = Launcher(W._mla_decode_fp8_ws_kernel, (head_blocks, b.batch_size, s), PAGE=pool.page_size,
                      DIRECT=split.direct, NUM_STAGES=W.GPU_CONFIG["num_stages"], SPLIT=False, SPARSE=sparse,
                      ROWS_LAG=W.ROWS_LAG, num_warps=4, maxnreg=W.MAXNREG)

    def run(q_nope, q_pe, layer, b_layer):
        kv, k_scale = kvs[layer], scales[layer]
        tok = b_layer.token_indices if sparse else b.kv_lens  # this layer's [B, topk] slots

        def stage1(o_buf, lse_buf, direct):
            triton.set_allocator(G._scratch)
            kernel(q_nope, q_pe, kv, num_rows, b.kv_indptr, b.kv_indices, b.kv_lens, tok, b.topk, o_buf, lse_buf,
                   float(sm_scale) * k_scale * LOG2E, k_scale, num_heads, s, q_nope.stride(0), q_nope.stride(1),
                   q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1))

        return split.run(stage1, k_scale)
    return run


class RowsPlan:
    """``mla_decode_fp8_rows`` (backends ``fp8_native.triton_rows`` / ``_acc``) planned for one batch,
    dense or sparse, either FP8 layout; checked here once, launches only per layer.

    Fixed here: the kernel's config (``rows_config``: tiles, constexprs, warps), each layer's row views
    and host k_scale, the int32 page table (dense), the split count (host lengths, or topk: no device
    read), the query buffers q8 [B, H, 2, 576] e4m3 and qsc [B, H] fp32 (shared by the layers: launches
    on one stream run in order), the partials and the merge (``SplitKV``). A sparse call takes the
    layer's slots from ``batch.token_indices`` ([B, topk] int32, contiguous), trusted as given.
    ``num_splits`` (None: the launcher's default) fixes the split count, as the launcher's argument;
    ``q_pre``: whether the query is quantized by a launch of its own (None: not at one request, where
    the host's launches cost more than the kernel; else the config's default).
    """

    def __init__(self, pool: KVPool, batch: DecodeBatch, num_heads: int, sm_scale: float, q_dtype, precision: str,
                 num_splits: int | None = None, q_pre: bool | None = None):
        dev, layout, B = pool.device, pool.kv_layout, batch.batch_size
        R.check_heads(num_heads, q_dtype)
        if q_pre is None and B == 1:  # one launch fewer; the kernel's time is the same (H200, run 10)
            q_pre = False
        self.cfg = R.rows_config(layout, precision, num_heads, dev, q_pre=q_pre)
        rows = [pool.rows(i) for i in range(pool.num_layers)]
        for r in rows:
            R.check_rows(r, layout, dev)
        self.views = [R.rows_views(r, layout) for r in rows]
        ds = layout == "fp8_ds_mla"  # its rows carry their own scales
        self.k_scales = [1.0] * pool.num_layers if ds else [float(s) for s in pool.k_scale.tolist()]
        self.qk_scales = [float(sm_scale) * k * LOG2E for k in self.k_scales]
        self.sparse = bool(batch.topk)
        if self.sparse:
            _check_slots(batch.token_indices, B, dev)
            self.table, self.page, max_len = None, 1, batch.topk
        else:
            R.check_page_size(pool.page_size, rows[0])
            self.table = (R.check_int32("kv_indptr", batch.kv_indptr, (B + 1,), dev),
                          R.check_int32("kv_indices", batch.kv_indices, None, dev),
                          R.check_int32("kv_lens", batch.kv_lens, (B,), dev))
            self.page, max_len = pool.page_size, batch.max_len
        s = resolve_splits("mla_decode_fp8_rows", num_splits, B, triton.cdiv(num_heads, self.cfg.block_h), None,
                           max_len, self.cfg.block_n, dev, self.cfg.ctas_per_sm)
        self.split = SplitKV.make(B, num_heads, s, q_dtype, dev)
        self.grid, self.q_grid = R.grids(self.cfg, B, num_heads, s)
        self.q8 = self.qsc = self.split.lse  # read by nothing when the kernel quantizes or widens the query
        self.quantize = None
        if self.cfg.quantize is not None:
            self.q8 = torch.empty(B, num_heads, 2, 576, dtype=torch.float8_e4m3fn, device=dev)
            self.qsc = torch.empty(B, num_heads, dtype=torch.float32, device=dev)
            self.quantize = R.query_launcher(self.cfg, self.q_grid)
        self.kernel = R.rows_launcher(self.cfg, self.grid, sparse=self.sparse, page=self.page,
                                      direct=self.split.direct)

    def __call__(self, q_nope, q_pe, layer: int, batch: DecodeBatch):
        """q_nope [B, H, 512], q_pe [B, H, 64] of the planned dtype -> out [B, H, 512]."""
        k_scale = self.k_scales[layer]
        if self.sparse:
            tok = batch.token_indices
            table, topk = (tok, tok, tok), tok.shape[1]  # the page table is not read: any int32 tensor
        else:
            table, topk = self.table, 0
            tok = table[2]

        def stage1(o_buf, lse_buf, direct):
            if self.quantize is not None:
                R.quantize_query(self.quantize, q_nope, q_pe, self.q8, self.qsc)
            R.launch_rows(self.kernel, q_nope, q_pe, self.views[layer], *table, tok, self.q8, self.qsc, o_buf,
                          lse_buf, self.qk_scales[layer], k_scale / R.P_SCALE, topk)

        return self.split.run(stage1, k_scale)


def _check_slots(token_indices: torch.Tensor, batch_size: int, device) -> None:
    """A sparse batch's slots as the rows kernel reads them: int32 [B, topk] or [num_layers, B, topk],
    contiguous, on the pool's device (each layer's [B, topk] is then contiguous too)."""
    t = token_indices
    if t.dtype != torch.int32 or t.device != device or t.dim() not in (2, 3) or t.shape[-2] != batch_size \
            or not t.is_contiguous():
        raise ValueError(f"token_indices must be a contiguous int32 [{batch_size}, topk] or [num_layers, "
                         f"{batch_size}, topk] tensor on {device}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def fp8_rows(precision: str):
    """Planner of the rows kernel at ``precision`` ("fast" or "accurate") with its default config."""
    def planner(pool, batch, num_heads, sm_scale, q_dtype):
        return RowsPlan(pool, batch, num_heads, sm_scale, q_dtype, precision)
    return planner
