"""Paged absorbed-MLA decode over FP8 (e4m3) pages at 64 heads a CTA, warp-specialized (Gluon, Hopper).

The function of ``mla_decode_fp8_gluon`` for dense pages at 33-128 heads, with its tile chain cut
in two so that one warpgroup's softmax runs under the other's MMAs (the schedule FlashMLA uses):

* One CTA per (request, 64-head block, split), three partitions: a producer warp that TMA-copies
  each 64-token tile ([64, 576] e4m3) into a ring of NUM_STAGES buffers, and two consumer
  warpgroups. Consumer w owns the tiles t = w, w + 2, ... (their scores and softmax) and output
  columns 256 w .. 256 w + 255 of every tile (p @ V).
* Scores with the heads on the MMA's M side: s [64 heads, 64 tokens] = q @ K^T, the e4m3 query as
  the A operand and the tile as B, both from shared memory (K-major); a head's row max and sum stay
  within a quad of threads.
* The owner of tile t reads m_{t-1} (the other warpgroup's running max), writes m_t, alpha_t =
  2^(m_{t-1} - m_t) and p_t (e4m3, x P_SCALE) to shared memory and arrives ``p_ready``; then both
  warpgroups rescale their accumulator by alpha_t and add V_t^T @ p_t^T: V^T (their 256 columns)
  is the A operand in registers, relabelled as in ``mla_decode_fp8_gluon`` (``_col_of_row8``),
  p^T the B operand from shared memory. A ring slot is refilled once both have read it
  (``empty``, two arrivals); a p buffer is rewritten once the other warpgroup is done with it
  (``p_free``).
* Each owner keeps the sum l of its own tiles' p; at the end the two sums meet at the last max.
* precision="accurate" (``SPLIT``): q and p each as two e4m3 terms, as in ``mla_decode_fp8_gluon``.

Shared memory: NUM_STAGES x 36 KB of tiles + 64 x 576 B of query + 2 x 64 x 64 B of p (x2 each when
accurate) + 2 KB of softmax state. Moves L*576 B of KV + B*H*(576 + 512)*2 B of queries and outputs
(+ B*H*S*513*4 B of split partials, twice); 2*H*L*(576 + 512) FLOPs.
Needs a Hopper GPU (sm_90) and Gluon with warp_specialize (Triton >= 3.6); dense pages of 64 or 128.
"""
from __future__ import annotations

import torch
import triton

from .mla_decode import LOG2E, check_decode_args, decode_buffers, resolve_splits
from .mla_merge import mla_merge
from . import mla_decode_fp8_gluon as G

HAS_WS = G.HAS_GLUON and hasattr(getattr(G, "gl", None), "warp_specialize")
if HAS_WS:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

BLOCK_H = 64  # heads a CTA: the score MMA's M
# Measured on the H200: see docs/perf-notes.md (run 14). One CTA an SM (NUM_STAGES x 36 KB of ring).
GPU_CONFIG = dict(num_stages=4, ctas_per_sm=1, min_tiles=1, max_splits=128)
ACCURATE_STAGES = 3  # two e4m3 terms of q and p: 4 stages would need 256 KB of shared memory
# Where ``fp8_native.gluon`` takes this kernel (``preferred``); measured on the H200 (run 14, graph
# medians, against mla_decode_fp8_gluon in the same call): 128 heads 64 x 8K 230.9 us against 274.1;
# 64 heads 156.1 against 153.0 (a draw: not taken); one request of 8K (splits of 1-2 tiles) 38.2 against
# 23.2 at 128 heads (the partitions' start-up); accurate (q and p in two terms: 2 KB of spills) 619.5
# against 535.8.
MIN_TILES = 16  # per split
ROWS_LAG = 1  # sparse: tiles issued past the one the producer waits for (``_producer_rows``)
# Sparse slots at more than 64 heads (see ``preferred``): measured slower than mla_decode_fp8_gluon (run 16,
# top-2048 of 32K, 128 heads 128 requests: 223.1 us against 208.1 on an H100; 64 requests a draw, 100.8
# against 101.3), so off the planned path.
SPARSE_PREFERRED = False


MAXNREG = 168  # 12 warps (3 warpgroups) at launch: 168 x 384 <= 64K registers
CONSUMER_REGS, PRODUCER_REGS = 240, 24  # after setmaxnreg: 2 x 128 x 240 + 128 x 24 <= 64K
if HAS_WS:
    _REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])

# V^T relabelling for one warpgroup's 256 columns: ``mla_decode_fp8_gluon``'s 8-warp split with the
# warpgroup's column bit (c8) dropped. [c7, c6, c5, c4, c3, c2c1, c0, t5t4, t3t2, t1t0] -> rows m, k
V_SPLIT_H = (2, 2, 2, 2, 2, 4, 2, 4, 4, 4)
# out^T [m7m6, m5, m4, m3, m2, m1, m0, H] -> columns (m7m6 = c2c1, m5 = c7, m4 = c5, m3 = c0, m2 = c4,
# m1 = c6, m0 = c3)
ACC_SPLIT_H = (4, 2, 2, 2, 2, 2, 2)
V_LAYOUT_BASES_H = dict(reg=G.V_LAYOUT_BASES8["reg"], lane=G.V_LAYOUT_BASES8["lane"],
                        warp=G.V_LAYOUT_BASES8["warp"][:2])

if HAS_WS:
    @triton.constexpr_function
    def _v_layout():
        """[64 tokens, 256 columns] of a V tile in one warpgroup's registers (``V_LAYOUT_BASES_H``)."""
        b = V_LAYOUT_BASES_H
        return gl.DistributedLinearLayout(reg_bases=b["reg"], lane_bases=b["lane"], warp_bases=b["warp"],
                                          block_bases=[], shape=[64, 256])

    @triton.constexpr_function
    def _mma_layout():
        """The MMAs' accumulators on one warpgroup: s [64 heads, 64 tokens], out^T [256, 64 heads]."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])

    @gluon.jit
    def _relabel_v(v, a_layout: gl.constexpr):
        """[64 tokens, 256 columns] -> V^T [256 rows m, 64 k] in the A-operand layout (renames only)."""
        vt = gl.permute(v, (1, 0))
        vt = gl.reshape(vt, [2, 2, 2, 2, 2, 4, 2, 4, 4, 4])
        vt = gl.permute(vt, (5, 0, 2, 6, 3, 1, 4, 7, 9, 8))
        vt = gl.reshape(vt, [256, 64])
        return gl.convert_layout(vt, a_layout)

    @gluon.jit
    def _unrelabel_acc(acc):
        """out^T [256 rows m, 64] -> [256 columns, 64]."""
        acc = gl.reshape(acc, [4, 2, 2, 2, 2, 2, 2, 64])
        acc = gl.permute(acc, (1, 5, 2, 4, 6, 0, 3, 7))
        return gl.reshape(acc, [256, 64])

    @gluon.jit
    def _producer(a, WG: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                  DIRECT: gl.constexpr, SPARSE: gl.constexpr, LAG: gl.constexpr):
        """Every tile of the split into the ring, a slot refilled once both consumers freed it: one warp
        of TMA copies (pages), or a warpgroup of cp.async row copies (``SPARSE``)."""
        if SPARSE:
            _producer_rows(a, NUM_STAGES, LAG)
        else:
            _producer_tma(a, NUM_STAGES, PAGE)

    @triton.constexpr_function
    def _rows_layout(width):
        """Row copies of 16 bytes a thread: a warp covers 4 rows of 128 B (width 128) or 8 of 64 B."""
        return gl.BlockedLayout([1, 16], [4, 8] if width == 128 else [8, 4], [4, 1], [1, 0])

    @gluon.jit
    def _tile_slots(a, t):
        """Sparse tile t's 64 token slots (-1 past the split's end), in the two copy layouts."""
        tok_ptr, start, end = a[6][0], a[3][2], a[3][3]
        n = start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _rows_layout(128)))
        n_pe = start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _rows_layout(64)))
        return (gl.load(tok_ptr + n, mask=n < end, other=-1), gl.load(tok_ptr + n_pe, mask=n_pe < end, other=-1))

    @gluon.jit
    def _copy_tile(a, slot, tok, tok_pe):
        """Rows ``tok`` into ring slot ``slot`` by cp.async (Hopper's TMA has no row gather), 4 passes of
        128 columns and one of the 64 RoPE bytes; a -1 slot is zero-filled. The slots go to shared
        memory for the consumers' masks. One commit group."""
        ckv_ring, kpe_ring, slots = a[1][0], a[1][1], a[1][6]
        kv_ptr = a[6][1]
        slots.index(slot).store(tok)
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, _rows_layout(128)))
        rows = kv_ptr + tok.to(gl.int64)[:, None] * 576
        for i in gl.static_range(4):
            async_copy.async_copy_global_to_shared(ckv_ring.index(slot).slice(i * 128, 128, dim=1),
                                                   rows + (i * 128 + c)[None, :], mask=(tok >= 0)[:, None])
        cp = gl.arange(0, 64, layout=gl.SliceLayout(0, _rows_layout(64)))
        async_copy.async_copy_global_to_shared(kpe_ring.index(slot), kv_ptr + 512 + tok_pe.to(gl.int64)[:, None] * 576
                                               + cp[None, :], mask=(tok_pe >= 0)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _publish(a, t, NUM_STAGES: gl.constexpr):
        """Tile t's rows are in (its copies waited for): visible to the MMAs' proxy, then ``full``."""
        fence_async_shared()
        G._cta_barrier()  # every producer thread's copies and fences before the one arrival
        mbarrier.arrive(a[2][0].index(t % NUM_STAGES), count=1)

    @gluon.jit
    def _producer_rows(a, NUM_STAGES: gl.constexpr, LAG: gl.constexpr):
        """Sparse: tile t published once tile t + LAG is issued, so LAG + 1 tiles' rows are in flight
        while the producer waits. LAG < NUM_STAGES - 1: the ring slot of t + LAG is freed by p @ V of
        t + LAG - NUM_STAGES, which both consumers finish before they need tile t. (Loading tile t + 1's
        slots under tile t's copies measured slower: 232.3 against 222 us, run 17a.)"""
        empty = a[2][1]
        n_tiles = a[3][5]
        for t in range(n_tiles):
            slot = t % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)  # the first round passes
            tok, tok_pe = _tile_slots(a, t)
            _copy_tile(a, slot, tok, tok_pe)
            if t >= LAG:
                async_copy.wait_group(LAG)
                _publish(a, t - LAG, NUM_STAGES)
        async_copy.wait_group(0)
        for t in range(gl.maximum(n_tiles - LAG, 0), n_tiles):
            _publish(a, t, NUM_STAGES)

    @gluon.jit
    def _producer_tma(a, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr):
        """Dense: one warp, a 64-token tile of one page by two TMA copies."""
        ckv_desc, kpe_desc, ckv_tail, kpe_tail = a[0]
        ckv_ring, kpe_ring = a[1][0], a[1][1]
        full, empty = a[2][0], a[2][1]
        kv_indices_ptr, page_base, start, end, n_full, n_tiles = a[3]
        for t in range(n_tiles):
            slot = t % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)  # the first round passes
            bar = full.index(slot)
            mbarrier.expect(bar, 64 * 576)
            if t < n_full:
                n0 = start + t * 64
                row = gl.load(kv_indices_ptr + page_base + n0 // PAGE) * PAGE + n0 % PAGE
                tma.async_copy_global_to_shared(ckv_desc, [row, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_desc, [row, 0], bar, kpe_ring.index(slot))
            else:  # the partial last tile: rows past the request's end arrive as zeros
                tma.async_copy_global_to_shared(ckv_tail, [0, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_tail, [0, 0], bar, kpe_ring.index(slot))

    @gluon.jit
    def _pv_issue(a, acc, t, WG: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):
        """acc * alpha_t + V_t^T @ p_t^T on this warpgroup's 256 columns, issued (1 wgmma group; SPLIT 2)."""
        ckv_ring, p_smem, stat = a[1][0], a[1][4], a[1][5]
        NQ: gl.constexpr = 2 if SPLIT else 1
        b = t % 2
        v = ckv_ring.index(t % NUM_STAGES).slice(256 * WG, 256, dim=1).load(_v_layout())
        acc = acc * stat.index(2 + b).load(gl.SliceLayout(0, acc.type.layout))[None, :]
        vt = _relabel_v(v, gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=4))
        acc = warpgroup_mma(vt, p_smem.index(b * NQ).permute((1, 0)), acc, is_async=True)
        if SPLIT:
            acc = warpgroup_mma(vt, p_smem.index(b * NQ + 1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _pv_done(a, t, WG: gl.constexpr, NUM_STAGES: gl.constexpr):
        """After p @ V of tile t has retired: its ring slot, and (the other warpgroup's tile) its p buffer."""
        empty, p_free = a[2][1], a[2][3]
        mbarrier.arrive(empty.index(t % NUM_STAGES), count=1)
        mbarrier.arrive(p_free.index(t % 2), count=1, pred=t % 2 != WG)

    @gluon.jit
    def _pv(a, acc, t, WG: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):
        """``_pv_issue``, waited, then ``_pv_done``."""
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(_pv_issue(a, acc, t, WG, NUM_STAGES, SPLIT), ))
        _pv_done(a, t, WG, NUM_STAGES)
        return acc

    @gluon.jit
    def _scores_issue(a, t, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):
        """s [64 heads, 64 tokens] = q @ K_t^T once tile t is in (2 wgmma groups; SPLIT 4), issued."""
        ckv_ring, kpe_ring, qn_smem, qp_smem = a[1][0], a[1][1], a[1][2], a[1][3]
        full = a[2][0]
        slot = t % NUM_STAGES
        mbarrier.wait(full.index(slot), (t // NUM_STAGES) & 1)
        ckv = ckv_ring.index(slot).permute((1, 0))
        kpe = kpe_ring.index(slot).permute((1, 0))
        s = warpgroup_mma(qn_smem.index(0), ckv, gl.zeros([64, 64], gl.float32, _mma_layout()), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(qp_smem.index(0), kpe, s, is_async=True)
        if SPLIT:
            s = warpgroup_mma(qn_smem.index(1), ckv, s, is_async=True)
            s = warpgroup_mma(qp_smem.index(1), kpe, s, is_async=True)
        return s

    @gluon.jit
    def _valid(a, t, SPARSE: gl.constexpr, NUM_STAGES: gl.constexpr):
        """[64] which of tile t's tokens count: before the split's end and (sparse) a slot >= 0."""
        if SPARSE:  # the producer's copy of the tile's slots (-1 past the end)
            return a[1][6].index(t % NUM_STAGES).load(gl.SliceLayout(0, _mma_layout())) >= 0
        start, end = a[3][2], a[3][3]
        return start + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, _mma_layout())) < end

    @gluon.jit
    def _softmax(a, t, s, valid, m_own, l_own, WG: gl.constexpr, SPLIT: gl.constexpr):
        """Tile t's scores s (this warpgroup's tile) -> the running max after it; p_t, m_t and
        alpha_t published to the other warpgroup (``p_ready``)."""
        p_smem, stat = a[1][4], a[1][5]
        p_ready, p_free = a[2][2], a[2][3]
        qk_scale = a[4][0]
        NQ: gl.constexpr = 2 if SPLIT else 1
        s_layout: gl.constexpr = _mma_layout()
        s = gl.where(valid[None, :], s * qk_scale, -float("inf"))
        row_max = gl.max(s, axis=1)
        b = t % 2
        if t > 0:  # m_{t-1} from the other warpgroup
            mbarrier.wait(p_ready.index(1 - b), ((t - 1) // 2) & 1)
            m_prev = stat.index(1 - b).load(gl.SliceLayout(1, s_layout))
        else:
            m_prev = gl.full([64], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        m_new = gl.maximum(m_prev, row_max)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        l_own = l_own * gl.exp2(m_own - m_use) + gl.sum(p, axis=1)
        if t >= 2:  # the other warpgroup is done with this buffer's previous p
            mbarrier.wait(p_free.index(b), ((t // 2) - 1) & 1)
        stat.index(b).store(m_new)
        stat.index(2 + b).store(gl.exp2(m_prev - m_use))
        p = gl.permute(gl.reshape(p, [64, 4, 4, 4]), (0, 1, 3, 2))  # tokens in _token_of_k order
        p = gl.reshape(p, [64, 64])
        if SPLIT:
            G._store_split(p_smem, p * 16.0, True, 0, b * NQ)  # two terms: 256 p in the MMA
        else:
            G._store_split(p_smem, p * G._P_SCALE, False, 0, b * NQ)
        fence_async_shared()
        G._cta_barrier()  # this warpgroup's stores are all in (its own p @ V reads them next)
        mbarrier.arrive(p_ready.index(b), count=1)
        return m_new, l_own

    @gluon.jit
    def _own_tile(a, t, acc, m_own, l_own, WG: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr,
                  SPARSE: gl.constexpr):
        """Tile t (this warpgroup's): its scores and softmax, then p @ V of the other's tile t - 1 and
        of t. (Issuing p @ V of t - 1 behind the scores of t, the softmax under it, took 169 us
        against 154 at 64 heads, 64 x 8K: the softmax chain between the warpgroups is the longer.)"""
        s = _scores_issue(a, t, NUM_STAGES, SPLIT)
        valid = _valid(a, t, SPARSE, NUM_STAGES)  # (sparse: the slots from shared memory, under the MMA)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        m_own, l_own = _softmax(a, t, s, valid, m_own, l_own, WG, SPLIT)
        if t > 0:
            acc = _pv(a, acc, t - 1, WG, NUM_STAGES, SPLIT)
        acc = _pv(a, acc, t, WG, NUM_STAGES, SPLIT)
        return acc, m_own, l_own

    @gluon.jit
    def _consumer(a, WG: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                  DIRECT: gl.constexpr, SPARSE: gl.constexpr):
        """Warpgroup WG: the softmax of tiles WG, WG + 2, ..., p @ V of every tile on its 256 columns,
        then its columns of the output."""
        stat = a[1][5]
        p_ready, fin = a[2][2], a[2][4]
        n_tiles = a[3][5]
        row_l: gl.constexpr = gl.SliceLayout(1, _mma_layout())
        m_own = gl.full([64], -float("inf"), gl.float32, row_l)
        l_own = gl.zeros([64], gl.float32, row_l)
        acc = gl.zeros([256, 64], gl.float32, _mma_layout())  # out^T, rows relabelled
        for t in range(WG, n_tiles, 2):
            acc, m_own, l_own = _own_tile(a, t, acc, m_own, l_own, WG, NUM_STAGES, SPLIT, SPARSE)
        last = n_tiles - 1
        if (last >= 0) & (last % 2 != WG):  # the last tile is the other warpgroup's
            mbarrier.wait(p_ready.index(last % 2), (last // 2) & 1)
            acc = _pv(a, acc, last, WG, NUM_STAGES, SPLIT)
        # the two sums of p meet at the last running max
        stat.index(4 + WG).store(m_own)
        stat.index(6 + WG).store(l_own)
        G._cta_barrier()
        mbarrier.arrive(fin.index(0), count=1)
        mbarrier.wait(fin.index(0), 0)
        _epilogue(a, acc, WG, DIRECT)

    @gluon.jit
    def _epilogue(a, acc, WG: gl.constexpr, DIRECT: gl.constexpr):
        """This warpgroup's 256 columns of the split's output (and, from warpgroup 0, its lse)."""
        stat = a[1][5]
        o_ptr, lse_ptr, b, hblk, H, num_splits, split, stride_o_b, stride_o_h = a[5]
        out_scale = a[4][1]
        o_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        vec_l: gl.constexpr = gl.SliceLayout(0, o_layout)
        m0 = stat.index(4).load(vec_l)
        m1 = stat.index(5).load(vec_l)
        m_fin = gl.maximum(m0, m1)
        m_use = gl.where(m_fin == -float("inf"), 0.0, m_fin)
        l_i = stat.index(6).load(vec_l) * gl.exp2(m0 - m_use) + stat.index(7).load(vec_l) * gl.exp2(m1 - m_use)
        out = gl.convert_layout(_unrelabel_acc(acc), o_layout)
        l_safe = gl.maximum(l_i, 1e-30)
        inv = gl.where(l_i > 0, 1.0 / (l_safe * G._P_SCALE), 0.0)
        col = 256 * WG + gl.arange(0, 256, layout=gl.SliceLayout(1, o_layout))
        h_o = hblk * 64 + gl.arange(0, 64, layout=vec_l)
        hmask = (h_o < H)[None, :]
        if DIRECT:
            ptrs = o_ptr + b * stride_o_b + h_o[None, :] * stride_o_h + col[:, None]
            gl.store(ptrs, (out * (inv * out_scale)[None, :]).to(o_ptr.dtype.element_ty), mask=hmask)
            lse = gl.where(l_i > 0, (m_fin + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
            gl.store(lse_ptr + b * H + h_o, lse, mask=(h_o < H) & (WG == 0))
        else:
            row_o = (b * H + h_o) * num_splits + split
            gl.store(o_ptr + row_o[None, :] * 512 + col[:, None], (out * inv[None, :]).to(o_ptr.dtype.element_ty), mask=hmask)
            lse2 = gl.where(l_i > 0, m_fin + gl.log2(l_safe), -float("inf"))
            gl.store(lse_ptr + row_o, lse2, mask=(h_o < H) & (WG == 0))

    @gluon.jit
    def _descriptors(kv_ptr, num_rows, kv_indices_ptr, page_base, start, end, n_full, n_tiles, PAGE: gl.constexpr):
        """Dense: TMA descriptors of the pool as token rows, and of the partial last tile's rows (if any)
        up to the request's end, so that the box past it reads as zeros."""
        ckv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
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
        return ckv_desc, kpe_desc, ckv_tail, kpe_tail

    @gluon.jit(do_not_specialize=["H", "num_splits"])
    def _mla_decode_fp8_ws_kernel(
        q_nope_ptr,  # *[B, H, 512] bf16/fp16, last dim contiguous
        q_pe_ptr,  # *[B, H, 64]
        kv_ptr,  # *fp8e4nv [num_pages, PAGE, 576]: num_rows token rows of 576 bytes
        num_rows,  # num_pages * PAGE
        kv_indptr_ptr,  # *i32 [B + 1]
        kv_indices_ptr,  # *i32 [nnz] page ids
        kv_lens_ptr,  # *i32 [B]
        tok_ptr,  # SPARSE: *i32 [B, topk] token slots (global row ids, -1 = none)
        topk,  # SPARSE: slots per request
        o_ptr,  # *f32 or *bf16 [B, H, S, 512] partials, or *out dtype [B, H, 512] when DIRECT
        lse_ptr,  # *f32 [B, H, S] log2-sum-exp partials, or [B, H] natural log when DIRECT
        qk_scale,  # sm_scale * k_scale * log2(e)
        out_scale,  # v_scale; DIRECT only
        H,
        num_splits,  # S
        stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
        stride_o_b, stride_o_h,
        PAGE: gl.constexpr,  # page_size, a multiple of 64
        DIRECT: gl.constexpr,  # one split: write the final output and natural-log lse
        NUM_STAGES: gl.constexpr,  # tiles in the ring
        SPLIT: gl.constexpr,  # accurate: q and p each as two e4m3 terms
        SPARSE: gl.constexpr = False,  # attend to the slots in tok_ptr (rows by cp.async), not the pages
        ROWS_LAG: gl.constexpr = 1,  # SPARSE: tiles issued past the one the producer waits for
    ):
        hblk = gl.program_id(0)  # head blocks fastest: a request's blocks run side by side and share its rows in L2
        b = gl.program_id(1)
        split = gl.program_id(2)
        ckv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
        NQ: gl.constexpr = 2 if SPLIT else 1
        ckv_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 512], ckv_sl)
        kpe_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 64], kpe_sl)
        qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [NQ, 64, 512], ckv_sl)
        qp_smem = gl.allocate_shared_memory(gl.float8e4nv, [NQ, 64, 64], kpe_sl)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * NQ, 64, 64], kpe_sl)
        # rows: m_t and alpha_t of the two p buffers, then each warpgroup's last max and sum of p
        stat = gl.allocate_shared_memory(gl.float32, [8, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        slots = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(fin.index(0), count=2)

        if SPARSE:
            seq_len = topk
        else:
            seq_len = gl.load(kv_lens_ptr + b)
        page_base = gl.load(kv_indptr_ptr + b)
        split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), 64) * 64
        start = split * split_len
        end = gl.minimum(start + split_len, seq_len)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), 64)
        n_full = gl.maximum(end - start, 0) // 64
        if SPARSE:  # rows come by cp.async: no descriptors
            descs = (kv_ptr, kv_ptr, kv_ptr, kv_ptr)
        else:
            descs = _descriptors(kv_ptr, num_rows, kv_indices_ptr, page_base, start, end, n_full, n_tiles, PAGE)

        # the query in e4m3, one scale for the CTA (amax / 448; SPLIT: / 28, two terms), 128 columns a pass
        heads = hblk * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
        hmask = (heads < H)[:, None]
        qn_ptrs = q_nope_ptr + b * stride_qn_b + heads[:, None] * stride_qn_h
        qp_ptrs = q_pe_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h
        amax = gl.max(gl.max(gl.abs(G._load_q(qp_ptrs, hmask, 0, 64, q_layout)), axis=1), axis=0)
        for c0 in gl.static_range(0, 512, 128):
            amax = gl.maximum(amax, gl.max(gl.max(gl.abs(G._load_q(qn_ptrs, hmask, c0, 128, q_layout)), axis=1), axis=0))
        q_sc = gl.maximum(amax, 1e-12) / (28.0 if SPLIT else 448.0)
        for c0 in gl.static_range(0, 512, 128):
            G._store_split(qn_smem, G._load_q(qn_ptrs, hmask, c0, 128, q_layout) / q_sc, SPLIT, c0)
        G._store_split(qp_smem, G._load_q(qp_ptrs, hmask, 0, 64, q_layout) / q_sc, SPLIT)
        fence_async_shared()
        G._cta_barrier()
        qk_scale = qk_scale * q_sc * (0.0625 if SPLIT else 1.0)

        a = (descs, (ckv_ring, kpe_ring, qn_smem, qp_smem, p_smem, stat, slots),
             (full, empty, p_ready, p_free, fin), (kv_indices_ptr, page_base, start, end, n_full, n_tiles),
             (qk_scale, out_scale), (o_ptr, lse_ptr, b, hblk, H, num_splits, split, stride_o_b, stride_o_h),
             (tok_ptr + b.to(gl.int64) * topk, kv_ptr))
        gl.warp_specialize([(_consumer, (a, 0, NUM_STAGES, PAGE, SPLIT, DIRECT, SPARSE)),
                            (_consumer, (a, 1, NUM_STAGES, PAGE, SPLIT, DIRECT, SPARSE)),
                            (_producer, (a, 2, NUM_STAGES, PAGE, SPLIT, DIRECT, SPARSE, ROWS_LAG))],
                           [4, 4 if SPARSE else 1], _REGS)


def preferred(num_heads: int, kv_layout: str, sparse: bool, precision: str, split_len: int) -> bool:
    """Whether the planned FP8-native Gluon path launches this kernel rather than
    ``mla_decode_fp8_gluon``: per-tensor FP8, the fast precision, more than 64 heads (two head blocks),
    splits of at least MIN_TILES tiles (``split_len`` tokens: the sparse top-k's or the context's);
    sparse slots too where ``SPARSE_PREFERRED``."""
    return (HAS_WS and (SPARSE_PREFERRED or not sparse) and kv_layout == "fp8_per_tensor" and precision == "fast"
            and num_heads > BLOCK_H and split_len >= MIN_TILES * G.BLOCK_N)


def split_len(batch: int, num_heads: int, max_len: int, device) -> int:
    """The longest split (tokens) of this kernel's default split count (the same as the 64-head
    ``mla_decode_fp8_gluon``'s: one wave of one CTA an SM)."""
    s = resolve_splits("mla_decode_fp8_ws", None, batch, triton.cdiv(num_heads, BLOCK_H), None, max_len, G.BLOCK_N,
                       device, GPU_CONFIG["ctas_per_sm"], GPU_CONFIG["min_tiles"], GPU_CONFIG["max_splits"])
    return triton.cdiv(triton.cdiv(max_len, s), G.BLOCK_N) * G.BLOCK_N  # as the kernel cuts them: whole tiles


def mla_decode_fp8_ws(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                      v_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False, *,
                      num_stages: int | None = None, max_len: int | None = None, precision: str = "fast",
                      max_split_len: int | None = None, part_dtype: torch.dtype | None = None,
                      token_indices: torch.Tensor | None = None, rows_lag: int = ROWS_LAG):
    """Paged absorbed-MLA decode over an FP8 e4m3 pool, 64 heads a CTA, warp-specialized.

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128; blocks of 64 heads), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_buffer : [num_pages, page_size, 576] float8_e4m3fn, dense pages, page_size 64 or 128 (any with
        ``token_indices``); real = stored * k_scale.
    kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 page ids; kv_lens : [B] int32.
    sm_scale, k_scale, v_scale, num_splits, return_lse, max_len, precision, max_split_len, part_dtype : as in
        ``mla_decode_fp8_gluon``. num_stages : ring depth (36 KB each, 2..5).
    token_indices : sparse: [B, topk] int32 token slots (global rows page * page_size + slot, -1 = none,
        checked where made), read by cp.async from a producer warpgroup. rows_lag : sparse, tiles in
        flight beyond the one the producer waits for (1 .. num_stages - 2).

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32 (natural log).
    """
    B, H, page_size = check_decode_args("mla_decode_fp8_ws", q_nope, q_pe, kv_buffer, kv_indptr, kv_indices, kv_lens,
                                        kv_dtypes=(torch.float8_e4m3fn,))
    dev = q_nope.device
    sparse = token_indices is not None
    if precision not in G.PRECISIONS:
        raise ValueError(f"mla_decode_fp8_ws: precision={precision!r}; allowed {list(G.PRECISIONS)}")
    stages = num_stages or (ACCURATE_STAGES if precision == "accurate" else GPU_CONFIG["num_stages"])
    if stages not in (2, 3, 4, 5):
        raise ValueError(f"mla_decode_fp8_ws: num_stages={stages}; allowed 2..5 (36 KB each)")
    if sparse and not 1 <= rows_lag <= stages - 2:
        raise ValueError(f"mla_decode_fp8_ws: rows_lag={rows_lag}; allowed 1..{stages - 2} (num_stages - 2)")
    G.check_gluon_args(H, page_size, dev, sparse)
    if sparse and (token_indices.dtype != torch.int32 or token_indices.dim() != 2 or token_indices.shape[0] != B
                   or not token_indices.is_contiguous()):
        raise ValueError(f"mla_decode_fp8_ws: token_indices must be contiguous int32 [B={B}, topk], got "
                         f"{token_indices.dtype} {tuple(token_indices.shape)}")
    if not HAS_WS:
        raise ValueError(f"mla_decode_fp8_ws: Triton {triton.__version__} has no Gluon warp_specialize")
    if kv_buffer.stride(0) != page_size * 576:
        raise ValueError(f"mla_decode_fp8_ws: kv_buffer pages must be dense (stride(0) = page_size * 576), "
                         f"got strides {tuple(kv_buffer.stride())}")
    if v_scale is None:
        v_scale = k_scale
    head_blocks = triton.cdiv(H, BLOCK_H)
    topk = token_indices.shape[1] if sparse else 0
    if sparse:
        max_len = topk
    elif max_len is None:
        max_len = int(kv_lens.max()) if B else 0
    num_splits = resolve_splits("mla_decode_fp8_ws", num_splits, B, head_blocks, kv_lens, max_len, G.BLOCK_N, dev,
                                GPU_CONFIG["ctas_per_sm"], GPU_CONFIG["min_tiles"], GPU_CONFIG["max_splits"])
    num_splits = G.capped_splits(num_splits, max_len, precision, max_split_len)
    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev,
                                            G.part_dtype_for(precision, part_dtype))
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    triton.set_allocator(G._scratch)
    _mla_decode_fp8_ws_kernel[(head_blocks, B, num_splits)](
        q_nope, q_pe, kv_buffer, kv_buffer.shape[0] * page_size, kv_indptr, kv_indices, kv_lens,
        token_indices if sparse else kv_lens, topk, o_buf, lse_buf,
        float(sm_scale) * float(k_scale) * LOG2E, float(v_scale), H, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, DIRECT=direct, NUM_STAGES=stages, SPLIT=precision == "accurate", SPARSE=sparse,
        ROWS_LAG=rows_lag, num_warps=4,
        maxnreg=MAXNREG,
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, float(v_scale))
    return (out, lse) if return_lse else out
