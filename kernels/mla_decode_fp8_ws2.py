"""Paged absorbed-MLA decode over FP8 pages at 64 heads a CTA, warp-specialized, V^T in shared memory.

``mla_decode_fp8_ws`` with p @ V turned around: out [64 heads, 256 columns] += p [64, 64 tokens] @ V
[64 tokens, 256], both operands from shared memory, N = 256 (2 wgmma a tile a warpgroup instead of
8), heads on the M side of both products. An FP8 MMA reads B K-major (tokens contiguous), the pool
stores V token-major, so a producer warpgroup transposes each tile's 512 x 64 e4m3 V into a ring of
two V^T buffers as it lands (16 x 16-byte blocks a thread, in registers), off the consumers' chain:
they neither load V into registers nor permute its bytes.

* Partitions: consumer warpgroups 0 and 1 (the softmax of alternate tiles, p @ V of every tile on
  columns 256 w ..), a producer warpgroup (TMA of the tiles, the transposes).
* Barriers: ``full`` (a tile landed), ``empty`` (its slot read by the owner's score MMA and by the
  transpose: two arrivals), ``vt_ready`` / ``vt_empty`` (a V^T buffer written / read by both
  consumers), ``p_ready`` / ``p_free`` and ``fin`` as in ``mla_decode_fp8_ws``.
* precision "fast" only (q and p in e4m3, one scale for the query).

Shared memory: NUM_STAGES x 36 KB of tiles + 2 x 32 KB of V^T + 36 KB of query + 8 KB of p.
Moves L*576 B of KV + B*H*(576 + 512)*2 B of queries and outputs (+ B*H*S*513*4 B of partials,
twice); 2*H*L*(576 + 512) FLOPs. Hopper (sm_90), Gluon warp_specialize; dense pages of 64 or 128.
"""
from __future__ import annotations

import torch
import triton

from .mla_decode import LOG2E, check_decode_args, decode_buffers, resolve_splits
from .mla_merge import mla_merge
from . import mla_decode_fp8_gluon as G
from . import mla_decode_fp8_ws as W

HAS_WS = W.HAS_WS
if HAS_WS:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

GPU_CONFIG = dict(num_stages=3, ctas_per_sm=1, min_tiles=1, max_splits=128)  # 218 KB of shared memory
MAXNREG = 168  # 12 warps at launch
CONSUMER_REGS, PRODUCER_REGS = 216, 80  # 2 x 128 x 216 + 128 x 80 <= 64K
if HAS_WS:
    _REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])

    @triton.constexpr_function
    def _s_layout():
        """s [64 heads, 64 tokens] on one warpgroup."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])

    @triton.constexpr_function
    def _o_layout():
        """out [64 heads, 256 columns] on one warpgroup (m64n256k32)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32])

    @gluon.jit
    def _producer(a, WG: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, DIRECT: gl.constexpr):
        """Four warps: tiles into the ring (TMA), each tile's V transposed into a V^T buffer."""
        ckv_desc, kpe_desc, ckv_tail, kpe_tail = a[0]
        ckv_ring, kpe_ring, vt = a[1][0], a[1][1], a[1][2]
        full, empty, vt_ready, vt_empty = a[2][0], a[2][1], a[2][2], a[2][3]
        n_tiles = a[3][5]
        # a thread: a [16 tokens, 16 columns] block, 16-byte rows in and (transposed) out
        t_layout: gl.constexpr = gl.BlockedLayout([16, 16], [4, 8], [1, 4], [1, 0])
        for t in gl.static_range(NUM_STAGES):
            _load_tile(a, t, NUM_STAGES, PAGE)
        for t in range(n_tiles):
            slot = t % NUM_STAGES
            mbarrier.wait(full.index(slot), (t // NUM_STAGES) & 1)
            v = ckv_ring.index(slot).load(t_layout)  # [64 tokens, 512]
            mbarrier.arrive(empty.index(slot), count=1)  # the transpose's read is done
            mbarrier.wait(vt_empty.index(t % 2), ((t // 2) & 1) ^ 1)  # both consumers are done with t - 2
            vt.index(t % 2).store(gl.permute(v, (1, 0)))
            fence_async_shared()
            G._cta_barrier()
            mbarrier.arrive(vt_ready.index(t % 2), count=1)
            if t > 0:  # the previous tile's slot, once its score MMA is done too, takes tile t - 1 + NUM_STAGES
                u = t - 1 + NUM_STAGES
                if u < n_tiles:
                    mbarrier.wait(empty.index((t - 1) % NUM_STAGES), ((t - 1) // NUM_STAGES) & 1)
                    _load_tile(a, u, NUM_STAGES, PAGE)

    @gluon.jit
    def _load_tile(a, t, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr):
        """TMA of tile t (if it exists) into its slot; the partial last one through the tail descriptors."""
        ckv_desc, kpe_desc, ckv_tail, kpe_tail = a[0]
        ckv_ring, kpe_ring = a[1][0], a[1][1]
        full = a[2][0]
        kv_indices_ptr, page_base, start, end, n_full, n_tiles = a[3]
        if t < n_tiles:
            slot = t % NUM_STAGES
            bar = full.index(slot)
            mbarrier.expect(bar, 64 * 576)
            if t < n_full:
                n0 = start + t * 64
                row = gl.load(kv_indices_ptr + page_base + n0 // PAGE) * PAGE + n0 % PAGE
                tma.async_copy_global_to_shared(ckv_desc, [row, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_desc, [row, 0], bar, kpe_ring.index(slot))
            else:
                tma.async_copy_global_to_shared(ckv_tail, [0, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_tail, [0, 0], bar, kpe_ring.index(slot))

    @gluon.jit
    def _pv(a, acc, t, WG: gl.constexpr):
        """acc * alpha_t + p_t @ V_t on this warpgroup's 256 columns (both operands from shared memory),
        waited; then the V^T buffer and (the other warpgroup's tile) the p buffer are released."""
        vt, p_smem, stat = a[1][2], a[1][5], a[1][6]
        vt_ready, vt_empty, p_free = a[2][2], a[2][3], a[2][5]
        b = t % 2
        acc = acc * stat.index(2 + b).load(gl.SliceLayout(1, _o_layout()))[:, None]
        mbarrier.wait(vt_ready.index(b), (t // 2) & 1)
        acc = warpgroup_mma(p_smem.index(b), vt.index(b).slice(256 * WG, 256, dim=0).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(vt_empty.index(b), count=1)
        mbarrier.arrive(p_free.index(b), count=1, pred=b != WG)
        return acc

    @gluon.jit
    def _softmax(a, t, m_own, l_own, NUM_STAGES: gl.constexpr):
        """Tile t (this warpgroup's): scores (the slot released after them), the running max, p_t,
        m_t and alpha_t published (``p_ready``)."""
        ckv_ring, kpe_ring, qn_smem, qp_smem, p_smem, stat = a[1][0], a[1][1], a[1][3], a[1][4], a[1][5], a[1][6]
        full, empty, p_ready, p_free = a[2][0], a[2][1], a[2][4], a[2][5]
        start, end = a[3][2], a[3][3]
        qk_scale = a[4][0]
        s_layout: gl.constexpr = _s_layout()
        slot = t % NUM_STAGES
        mbarrier.wait(full.index(slot), (t // NUM_STAGES) & 1)
        s = warpgroup_mma(qn_smem, ckv_ring.index(slot).permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(qp_smem, kpe_ring.index(slot).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(empty.index(slot), count=1)
        tok = start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((tok < end)[None, :], s * qk_scale, -float("inf"))
        row_max = gl.max(s, axis=1)
        b = t % 2
        if t > 0:
            mbarrier.wait(p_ready.index(1 - b), ((t - 1) // 2) & 1)
            m_prev = stat.index(1 - b).load(gl.SliceLayout(1, s_layout))
        else:
            m_prev = gl.full([64], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        m_new = gl.maximum(m_prev, row_max)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        l_own = l_own * gl.exp2(m_own - m_use) + gl.sum(p, axis=1)
        if t >= 2:
            mbarrier.wait(p_free.index(b), ((t // 2) - 1) & 1)
        stat.index(b).store(m_new)
        stat.index(2 + b).store(gl.exp2(m_prev - m_use))
        p_smem.index(b).store((p * G._P_SCALE).to(gl.float8e4nv))
        fence_async_shared()
        G._cta_barrier()
        mbarrier.arrive(p_ready.index(b), count=1)
        return m_new, l_own

    @gluon.jit
    def _consumer(a, WG: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, DIRECT: gl.constexpr):
        """Warpgroup WG: the softmax of tiles WG, WG + 2, ..., p @ V of every tile, its output columns."""
        stat = a[1][6]
        p_ready, fin = a[2][4], a[2][6]
        n_tiles = a[3][5]
        row_l: gl.constexpr = gl.SliceLayout(1, _s_layout())
        m_own = gl.full([64], -float("inf"), gl.float32, row_l)
        l_own = gl.zeros([64], gl.float32, row_l)
        acc = gl.zeros([64, 256], gl.float32, _o_layout())
        for t in range(WG, n_tiles, 2):
            m_own, l_own = _softmax(a, t, m_own, l_own, NUM_STAGES)
            if t > 0:
                acc = _pv(a, acc, t - 1, WG)
            acc = _pv(a, acc, t, WG)
        last = n_tiles - 1
        if (last >= 0) & (last % 2 != WG):
            mbarrier.wait(p_ready.index(last % 2), (last // 2) & 1)
            acc = _pv(a, acc, last, WG)
        stat.index(4 + WG).store(m_own)
        stat.index(6 + WG).store(l_own)
        G._cta_barrier()
        mbarrier.arrive(fin.index(0), count=1)
        mbarrier.wait(fin.index(0), 0)
        _epilogue(a, acc, WG, DIRECT)

    @gluon.jit
    def _epilogue(a, acc, WG: gl.constexpr, DIRECT: gl.constexpr):
        """This warpgroup's 256 columns of the split's output (and, from warpgroup 0, its lse)."""
        stat = a[1][6]
        o_ptr, lse_ptr, b, hblk, H, num_splits, split, stride_o_b, stride_o_h = a[5]
        out_scale = a[4][1]
        o_layout: gl.constexpr = _o_layout()
        vec_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        m0 = stat.index(4).load(vec_l)
        m1 = stat.index(5).load(vec_l)
        m_fin = gl.maximum(m0, m1)
        m_use = gl.where(m_fin == -float("inf"), 0.0, m_fin)
        l_i = stat.index(6).load(vec_l) * gl.exp2(m0 - m_use) + stat.index(7).load(vec_l) * gl.exp2(m1 - m_use)
        l_safe = gl.maximum(l_i, 1e-30)
        inv = gl.where(l_i > 0, 1.0 / (l_safe * G._P_SCALE), 0.0)
        col = 256 * WG + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        h_o = hblk * 64 + gl.arange(0, 64, layout=vec_l)
        hmask = (h_o < H)[:, None]
        if DIRECT:
            ptrs = o_ptr + b * stride_o_b + h_o[:, None] * stride_o_h + col[None, :]
            gl.store(ptrs, (acc * (inv * out_scale)[:, None]).to(o_ptr.dtype.element_ty), mask=hmask)
            lse = gl.where(l_i > 0, (m_fin + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
            gl.store(lse_ptr + b * H + h_o, lse, mask=(h_o < H) & (WG == 0))
        else:
            row_o = (b * H + h_o) * num_splits + split
            gl.store(o_ptr + row_o[:, None] * 512 + col[None, :], acc * inv[:, None], mask=hmask)
            lse2 = gl.where(l_i > 0, m_fin + gl.log2(l_safe), -float("inf"))
            gl.store(lse_ptr + row_o, lse2, mask=(h_o < H) & (WG == 0))

    @gluon.jit(do_not_specialize=["H", "num_splits"])
    def _mla_decode_fp8_ws2_kernel(
        q_nope_ptr, q_pe_ptr,  # *[B, H, 512], *[B, H, 64] bf16/fp16, last dim contiguous
        kv_ptr,  # *fp8e4nv [num_pages, PAGE, 576]
        num_rows,  # num_pages * PAGE
        kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr,  # *i32 [B + 1], [nnz] page ids, [B]
        o_ptr,  # *f32 [B, H, S, 512] partials, or *out dtype [B, H, 512] when DIRECT
        lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
        qk_scale,  # sm_scale * k_scale * log2(e)
        out_scale,  # v_scale; DIRECT only
        H, num_splits,
        stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_o_b, stride_o_h,
        PAGE: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):
        b = gl.program_id(0)
        hblk = gl.program_id(1)
        split = gl.program_id(2)
        ckv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
        ckv_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 512], ckv_sl)
        kpe_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 64], kpe_sl)
        vt = gl.allocate_shared_memory(gl.float8e4nv, [2, 512, 64], kpe_sl)  # V^T [columns, tokens]: K-major B
        qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, 512], ckv_sl)
        qp_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, 64], kpe_sl)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], kpe_sl)  # p [heads, tokens]: K-major A
        stat = gl.allocate_shared_memory(gl.float32, [8, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        vt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(vt_ready.index(i), count=1)
            mbarrier.init(vt_empty.index(i), count=2)
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(fin.index(0), count=2)

        seq_len = gl.load(kv_lens_ptr + b)
        page_base = gl.load(kv_indptr_ptr + b)
        split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), 64) * 64
        start = split * split_len
        end = gl.minimum(start + split_len, seq_len)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), 64)
        n_full = gl.maximum(end - start, 0) // 64
        ckv_desc = tma.make_tensor_descriptor(kv_ptr, [num_rows, 512], [576, 1], [64, 512], ckv_sl)
        kpe_desc = tma.make_tensor_descriptor(kv_ptr + 512, [num_rows, 64], [576, 1], [64, 64], kpe_sl)
        if n_full < n_tiles:
            n0_tail = start + n_full * 64
            tail_row = gl.load(kv_indices_ptr + page_base + n0_tail // PAGE) * PAGE + n0_tail % PAGE
            tail_ptr = kv_ptr + tail_row.to(gl.int64) * 576
            ckv_tail = tma.make_tensor_descriptor(tail_ptr, [end - n0_tail, 512], [576, 1], [64, 512], ckv_sl)
            kpe_tail = tma.make_tensor_descriptor(tail_ptr + 512, [end - n0_tail, 64], [576, 1], [64, 64], kpe_sl)
        else:
            ckv_tail = ckv_desc
            kpe_tail = kpe_desc

        heads = hblk * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
        hmask = (heads < H)[:, None]
        qn_ptrs = q_nope_ptr + b * stride_qn_b + heads[:, None] * stride_qn_h
        qp_ptrs = q_pe_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h
        amax = gl.max(gl.max(gl.abs(G._load_q(qp_ptrs, hmask, 0, 64, q_layout)), axis=1), axis=0)
        for c0 in gl.static_range(0, 512, 128):
            amax = gl.maximum(amax, gl.max(gl.max(gl.abs(G._load_q(qn_ptrs, hmask, c0, 128, q_layout)), axis=1), axis=0))
        q_sc = gl.maximum(amax, 1e-12) / 448.0
        for c0 in gl.static_range(0, 512, 128):
            qn_smem.slice(c0, 128, dim=1).store((G._load_q(qn_ptrs, hmask, c0, 128, q_layout) / q_sc).to(gl.float8e4nv))
        qp_smem.store((G._load_q(qp_ptrs, hmask, 0, 64, q_layout) / q_sc).to(gl.float8e4nv))
        fence_async_shared()
        G._cta_barrier()

        a = ((ckv_desc, kpe_desc, ckv_tail, kpe_tail), (ckv_ring, kpe_ring, vt, qn_smem, qp_smem, p_smem, stat),
             (full, empty, vt_ready, vt_empty, p_ready, p_free, fin),
             (kv_indices_ptr, page_base, start, end, n_full, n_tiles), (qk_scale * q_sc, out_scale),
             (o_ptr, lse_ptr, b, hblk, H, num_splits, split, stride_o_b, stride_o_h))
        gl.warp_specialize([(_consumer, (a, 0, NUM_STAGES, PAGE, DIRECT)),
                            (_consumer, (a, 1, NUM_STAGES, PAGE, DIRECT)),
                            (_producer, (a, 2, NUM_STAGES, PAGE, DIRECT))],
                           [4, 4], _REGS)


def mla_decode_fp8_ws2(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                       kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                       v_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False, *,
                       num_stages: int | None = None, max_len: int | None = None):
    """``mla_decode_fp8_ws``'s interface (precision fast): out [B, H, 512] q dtype (and lse [B, H])."""
    B, H, page_size = check_decode_args("mla_decode_fp8_ws2", q_nope, q_pe, kv_buffer, kv_indptr, kv_indices,
                                        kv_lens, kv_dtypes=(torch.float8_e4m3fn,))
    dev = q_nope.device
    G.check_gluon_args(H, page_size, dev)
    if not HAS_WS:
        raise ValueError(f"mla_decode_fp8_ws2: Triton {triton.__version__} has no Gluon warp_specialize")
    if kv_buffer.stride(0) != page_size * 576:
        raise ValueError(f"mla_decode_fp8_ws2: kv_buffer pages must be dense (stride(0) = page_size * 576), "
                         f"got strides {tuple(kv_buffer.stride())}")
    stages = num_stages or GPU_CONFIG["num_stages"]
    if v_scale is None:
        v_scale = k_scale
    head_blocks = triton.cdiv(H, 64)
    if max_len is None:
        max_len = int(kv_lens.max()) if B else 0
    num_splits = resolve_splits("mla_decode_fp8_ws2", num_splits, B, head_blocks, kv_lens, max_len, G.BLOCK_N, dev,
                                GPU_CONFIG["ctas_per_sm"], GPU_CONFIG["min_tiles"], GPU_CONFIG["max_splits"])
    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev)
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    triton.set_allocator(G._scratch)
    _mla_decode_fp8_ws2_kernel[(B, head_blocks, num_splits)](
        q_nope, q_pe, kv_buffer, kv_buffer.shape[0] * page_size, kv_indptr, kv_indices, kv_lens, o_buf, lse_buf,
        float(sm_scale) * float(k_scale) * LOG2E, float(v_scale), H, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, DIRECT=direct, NUM_STAGES=stages, num_warps=4, maxnreg=MAXNREG,
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, float(v_scale))
    return (out, lse) if return_lse else out
