"""Paged absorbed-MLA decode over FP8 (e4m3) pages, both products in FP8 on Hopper tensor cores (Gluon).

The function of ``mla_decode_fp8`` (split-KV, ``mla_merge`` as stage 2, ``k_scale`` folded into the
softmax scale, ``v_scale`` into the output), written in Gluon (Triton's explicit-layout dialect)
so that V never goes through shared memory a second time:

* One CTA per (request, head block, split): one warpgroup (4 warps) for 16 or 32 heads; two (8
  warps) for a block of 64 heads (128 heads: two blocks), where the score MMA splits the heads
  between the warpgroups and p @ V splits the 512 rows (``_col_of_row8``: 8-byte loads of V).
  Each 64-token run of a page
  is a dense [64, 576] box of the pool: TMA copies it into a ring of NUM_STAGES shared-memory
  buffers, mbarriers say when a buffer is full, NUM_STAGES - 1 tiles stay in flight.
* Scores: s^T [64 tokens, BLOCK_H] = K @ q^T, one FP8 wgmma with the tile as the A operand straight
  from shared memory (K-major) and the query quantized to e4m3 in the prologue (one scale per CTA).
* Values: out^T [512, BLOCK_H] += V^T @ p^T, FP8 wgmma with V^T as the A operand *in registers*.
  An FP8 MMA reads its operands K-major (consecutive tokens), the pool stores consecutive columns.
  The 512 columns are relabelled (the MMA's row m holds column ``_col_of_row(m)``) so that every
  thread's 16 rows are 16 adjacent bytes of a token row, and the 64 tokens so that the 4 tokens a
  thread packs into one register come from 4 rows of distinct swizzle phase: V is read once,
  16 bytes a thread, conflict-free, and transposed by byte permutes in registers. p is scaled by
  P_SCALE (exact, a power of two) and stored as e4m3 into a [BLOCK_H, 64] buffer (the B operand).
  The relabelling is undone when the output is written (a free reshape, then one pass through
  shared memory so that the partials leave in 16-byte stores).
* Sparse (``token_indices``): a tile is 64 token slots; their rows come by cp.async (no row gather
  in TMA) into the same ring, -1 slots zero-filled and their scores -inf; any page size. On
  per-tensor rows (two warpgroups, or fast on one) the slots themselves come by cp.async into a
  shared-memory ring a ring's length ahead of their rows (``SLOT_RING``, ``use_slot_ring``), so no
  global load waits in the tile chain.
* Sparse on fp8_ds_mla rows (``DS``, 656 B: 512 e4m3 | 4 fp32 group scales | 64 bf16 RoPE): the
  rows' three parts come by cp.async into three rings; each token's groups are brought to its
  largest scale in place in shared memory, a 128-column group at a time (x 2^-k, exact unless a
  value falls into e4m3's subnormals), so the score MMA stays one K = 512 MMA; RoPE is a BF16 MMA
  against a BF16 q_pe; the token's scale multiplies its score row and, as log2(scale) added to the
  logits, its p (the running max is over scores + log2 scale, l sums the plain p); a token whose
  scales are zero (a -1 slot, zero-filled) is masked. Measured (H100, run 17g) 1.25-1.8x the
  per-tensor rows' time: the rescale's round trip and barrier sit before every tile's score MMA.
* Pipelined loop (``PIPE``, ``use_pipeline``: the fast precision's default at 17-32 heads, dense):
  a tile's score MMA, then the previous tile's p @ V, both issued before this tile's softmax, which
  runs under them; p in two buffers. At 16 and 64 heads it was slower (run 12: spills, a refill one
  tile later), so the plain chain stays there. (Issuing only the next tile's score MMA ahead of
  the softmax in the plain chain gained nothing at 16 heads and spilled at 64: run 13b.)
* precision="accurate" (``SPLIT``): q and p each as two e4m3 terms (16 hi + 16 (x - hi)) summed in
  the same accumulators; twice the MMAs, V unchanged.
* A split's partial last tile is fetched through descriptors whose rows end at the request's end:
  TMA fills the box past it with zeros (stale bytes, even NaN, never reach shared memory) and the
  scores there are masked to -inf; the loop over whole tiles runs unmasked.

Shared memory: NUM_STAGES x 36 KB of tiles + BLOCK_H x 576 B of query + BLOCK_H x 64 B of p (x2 each
when accurate; p x2 again in the pipelined loop).
Moves L*576 B of KV (L = tokens read, whole 64-token tiles) + B*H*(576 + 512)*2 B of queries and
outputs (+ B*H*S*513*4 B of split partials, twice); 2*H*L*(576 + 512) FLOPs (x BLOCK_H/H padded).
Error (H200, run 7b): fast, FP8 query (one scale per CTA) and FP8 probabilities, 2.7-2.9e-2 relative
to the exact result; accurate 2.0-2.6e-3 with splits of at most 4096 tokens (ACCURATE_SPLIT_LEN:
8192-token splits gave 3.7e-3 at 128 heads, dense 64 x 8K).
Needs a Hopper GPU (sm_90: wgmma, TMA) and Gluon (Triton >= 3.5); dense pages of 64 and 128, sparse
any; 1..128 heads; fp8_ds_mla sparse only.
"""
from __future__ import annotations

import functools

import torch
import triton

from .mla_decode import LOG2E, check_decode_args, decode_buffers, resolve_splits
from .mla_decode_fp8_rows import (DS_ROPE_AT_BF16, DS_ROW, DS_ROW_BF16, DS_ROW_F32, DS_SCALE_AT_F32, LAYOUT_ROW,
                                   rows_views)
from .mla_merge import mla_merge

try:  # Gluon: Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    HAS_GLUON = hasattr(tma, "make_tensor_descriptor")
except ImportError:  # pragma: no cover - old Triton
    HAS_GLUON = False

BLOCK_N = 64  # tokens per tile: one wgmma M block of scores, the K of p @ V
P_SCALE = 256.0  # p in [0, 1] is stored as e4m3 of p * 256 (keeps small p out of e4m3's subnormals)
MAX_HEADS = 128
PRECISIONS = ("fast", "accurate")  # accurate: q and p as two e4m3 terms each
WIDE_HEADS = 64  # above 32 heads: CTAs of two warpgroups and 64 heads (128 heads: two head blocks)
# Sparse slots (per-tensor rows) through a shared-memory ring where the CTA has this many warps (64 heads):
# measured side by side on an H100 (run 17b, top-2048 of 32K): 128 heads 128 requests 181.6 against 201.2
# us, 64 heads 60.0 against 65.1; on fp8_ds_mla rows 4-11% slower (run 17e), so those keep their slots'
# global loads. At one warpgroup the ring pays in the fast precision (H200, runs 27b-c, 16 heads 64
# requests: 33.6-33.8 against 34.8-35.0 us in three calls) and costs the accurate one (spills; run 17b).
SLOT_RING_WARPS = 8


def _col_of_row(m):
    """The V column (0..511) that the MMA's row m of out^T holds (works on ints and tensors):
    m bit 3 -> column bit 0, bits 6-8 -> bits 1-3 (a thread's 16 rows: 16 adjacent bytes),
    bit 1 -> 4, bit 2 -> 5, bit 0 -> 6 (the 8 lanes of a 16-byte load phase hit 8 swizzle slots),
    bits 4-5 (the warp) -> 7-8 (warp w reads the 128-column TMA box w)."""
    return (((m >> 3) & 1) | (((m >> 6) & 7) << 1) | (((m >> 1) & 1) << 4) | (((m >> 2) & 1) << 5)
            | ((m & 1) << 6) | (((m >> 4) & 3) << 7))


def _col_of_row8(m):
    """``_col_of_row`` for two warpgroups (8 warps): a thread holds rows m bits 3, 7, 8 -> columns
    bits 0-2 (8 adjacent bytes); lane bits m0 -> c3, m1 -> c6, m2 -> c4 (the 16 lanes of an 8-byte
    load phase hit 16 distinct bank slots); warp bits m4 -> c5, m5 -> c7, m6 (the warpgroup) -> c8."""
    return (((m >> 3) & 1) | (((m >> 7) & 3) << 1) | ((m & 1) << 3) | (((m >> 2) & 1) << 4)
            | (((m >> 4) & 1) << 5) | (((m >> 1) & 1) << 6) | (((m >> 5) & 3) << 7))


def _token_of_k(k):
    """The token (0..63) of a tile that the MMA's k index of p @ V holds: the 4 tokens a thread
    packs into one 32-bit register (k bits 0-1) are token bits 2-3; the lane's k bits 2-3 are
    token bits 0-1 (so 4 adjacent lanes read 4 adjacent rows: distinct swizzle phases)."""
    return (((k >> 2) & 3) | ((k & 3) << 2) | (k & 48))


# The V tile's register layout, as linear-layout bases of (token, column) for the 8 register, 5 lane
# and 2 warp bits: the wgmma A-operand layout (e4m3, k_width 4, 4 warps) of [512, 64] seen through
# _col_of_row / _token_of_k, with the 4 column bits first so that a thread's first 16 values are one
# 16-byte load (tests/test_gluon.py derives it from the PTX fragment layout).
V_LAYOUT_BASES = dict(reg=[[0, 1], [0, 2], [0, 4], [0, 8], [4, 0], [8, 0], [16, 0], [32, 0]],
                      lane=[[1, 0], [2, 0], [0, 64], [0, 16], [0, 32]], warp=[[0, 128], [0, 256]])

# The same for 8 warps (``_col_of_row8``): 8-byte loads, 128 values a thread.
V_LAYOUT_BASES8 = dict(reg=[[0, 1], [0, 2], [0, 4], [4, 0], [8, 0], [16, 0], [32, 0]],
                       lane=[[1, 0], [2, 0], [0, 8], [0, 64], [0, 16]], warp=[[0, 32], [0, 128], [0, 256]])

# The relabellings as reshape + permute, spelled out literally in the kernel (pure renames of
# registers there); tests/test_gluon.py replays them in torch against _col_of_row / _token_of_k
# and checks that the kernel's source spells the same numbers:
# V^T [512 col, 64 tok] -> [c8c7, c6, c5, c4, c3c2c1, c0, t5t4, t3t2, t1t0] -> rows m, k in MMA order
V_SPLIT, V_PERM = (4, 2, 2, 2, 8, 2, 4, 4, 4), (4, 0, 5, 2, 3, 1, 6, 8, 7)
# p [64 tok, H] -> [t5t4, t3t2, t1t0, H] -> p^T [H, k]
P_SPLIT, P_PERM = (4, 4, 4), (3, 0, 2, 1)
# out^T [512 m, H] -> [m8m7m6, m5m4, m3, m2, m1, m0, H] -> [512 col, H]
ACC_SPLIT, ACC_PERM = (8, 4, 2, 2, 2, 2), (1, 5, 3, 4, 0, 2, 6)
# 8 warps: [c8c7, c6, c5, c4, c3, c2c1, c0, t5t4, t3t2, t1t0] -> rows m (m8m7 = c2c1, m6m5 = c8c7, m4 = c5,
# m3 = c0, m2 = c4, m1 = c6, m0 = c3), k as above; out^T [m8m7, m6m5, m4, m3, m2, m1, m0, H] -> columns
V_SPLIT8, V_PERM8 = (4, 2, 2, 2, 2, 4, 2, 4, 4, 4), (5, 0, 2, 6, 3, 1, 4, 7, 9, 8)
ACC_SPLIT8, ACC_PERM8 = (4, 4, 2, 2, 2, 2, 2), (1, 5, 2, 4, 6, 0, 3, 7)

if HAS_GLUON:
    _P_SCALE = gl.constexpr(P_SCALE)

    @gluon.jit
    def _round_e4m3(x):
        """fp32 -> the e4m3 value nearest to x (ties to even) as fp32, for |x| <= 448: bit arithmetic
        (normals keep 3 mantissa bits, below 2^-6 steps of 2^-9), so that the residual x - hi of a
        split is exact and never read back from an fp8 register."""
        bits = x.to(gl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(gl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # 1.5 * 2^23: rounds to an integer
        return gl.where(gl.abs(x) < 0.015625, sub, normal)

    @gluon.jit
    def _store_split(smem, x, SPLIT: gl.constexpr, C0: gl.constexpr = 0, T0=0):
        """x [R, W] (|x| <= 448 fast, <= 28 SPLIT) into e4m3 at columns C0 .. C0 + W of smem
        [terms, R, *] from term T0: one term; or SPLIT two terms 16 * hi and 16 * (x - hi), both
        exact or normal e4m3, whose sum is 16 x to ~2^-8 relative."""
        W: gl.constexpr = x.shape[1]
        if SPLIT:
            hi = _round_e4m3(x)
            smem.index(T0).slice(C0, W, dim=1).store((hi * 16.0).to(gl.float8e4nv))
            smem.index(T0 + 1).slice(C0, W, dim=1).store(((x - hi) * 16.0).to(gl.float8e4nv))
        else:
            smem.index(T0).slice(C0, W, dim=1).store(x.to(gl.float8e4nv))

    @gluon.jit
    def _load_q(ptrs, hmask, C0: gl.constexpr, W: gl.constexpr, layout: gl.constexpr):
        """Columns C0 .. C0 + W of a [BLOCK_H, *] query block as fp32 (128 at a time keeps the
        prologue's registers within what the main loop needs)."""
        c = C0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
        return gl.load(ptrs + c[None, :], mask=hmask, other=0.0).to(gl.float32)
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed in Triton 3.7

    @triton.constexpr_function
    def _v_layout(num_warps):
        """Register layout of a [64 tokens, 512 columns] V tile (``V_LAYOUT_BASES``, 8 warps: ``...8``)."""
        b = V_LAYOUT_BASES if num_warps == 4 else V_LAYOUT_BASES8
        return gl.DistributedLinearLayout(reg_bases=b["reg"], lane_bases=b["lane"], warp_bases=b["warp"],
                                          block_bases=[], shape=[64, 512])

    @triton.constexpr_function
    def _s_layout(num_warps, block_h):
        """Scores s^T [64 tokens, BLOCK_H]: with two warpgroups each takes half of the heads (N)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                         instr_shape=[16, block_h * 4 // num_warps, 32])

    @triton.constexpr_function
    def _acc_layout(num_warps, block_h):
        """out^T [512 rows, BLOCK_H]: with two warpgroups each takes 256 of the rows (M), all heads."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_h, 32])

    @gluon.jit
    def _relabel_v(v, a_layout: gl.constexpr, NUM_WARPS: gl.constexpr):
        """[64 tokens, 512 columns] -> V^T relabelled [512 rows m, 64 k] in the A-operand layout:
        A[m, k] = V[_token_of_k(k), _col_of_row(m)] (8 warps: _col_of_row8). Reshapes and permutes
        only rename registers."""
        vt = gl.permute(v, (1, 0))  # [512 col, 64 tok]
        if NUM_WARPS == 4:
            # column c = (c8 c7 | c6 | c5 | c4 | c3 c2 c1 | c0), token t = (t5 t4 | t3 t2 | t1 t0)
            vt = gl.reshape(vt, [4, 2, 2, 2, 8, 2, 4, 4, 4])
            # row m = (m8 m7 m6 = c3 c2 c1 | m5 m4 = c8 c7 | m3 = c0 | m2 = c5 | m1 = c4 | m0 = c6),
            # k = (k5 k4 = t5 t4 | k3 k2 = t1 t0 | k1 k0 = t3 t2)
            vt = gl.permute(vt, (4, 0, 5, 2, 3, 1, 6, 8, 7))
        else:
            # column c = (c8 c7 | c6 | c5 | c4 | c3 | c2 c1 | c0)
            vt = gl.reshape(vt, [4, 2, 2, 2, 2, 4, 2, 4, 4, 4])
            # row m = (m8 m7 = c2 c1 | m6 m5 = c8 c7 | m4 = c5 | m3 = c0 | m2 = c4 | m1 = c6 | m0 = c3)
            vt = gl.permute(vt, (5, 0, 2, 6, 3, 1, 4, 7, 9, 8))
        vt = gl.reshape(vt, [512, 64])
        return gl.convert_layout(vt, a_layout)

    @gluon.jit
    def _relabel_p(p):
        """p [64 tokens, BLOCK_H] -> p^T [BLOCK_H, 64 k] with k ordered as _token_of_k."""
        BH: gl.constexpr = p.shape[1]
        p = gl.reshape(p, [4, 4, 4, BH])  # t = (t5 t4 | t3 t2 | t1 t0)
        p = gl.permute(p, (3, 0, 2, 1))  # [BH, t5t4, t1t0, t3t2]
        return gl.reshape(p, [BH, 64])

    @gluon.jit
    def _unrelabel_acc(acc, NUM_WARPS: gl.constexpr):
        """out^T [512 rows m, BLOCK_H] -> [512 columns, BLOCK_H]: row m holds column _col_of_row(m)."""
        BH: gl.constexpr = acc.shape[1]
        if NUM_WARPS == 4:
            acc = gl.reshape(acc, [8, 4, 2, 2, 2, 2, BH])  # m = (m8 m7 m6 | m5 m4 | m3 | m2 | m1 | m0)
            # column = (c8 c7 = m5 m4 | c6 = m0 | c5 = m2 | c4 = m1 | c3 c2 c1 = m8 m7 m6 | c0 = m3)
            acc = gl.permute(acc, (1, 5, 3, 4, 0, 2, 6))
        else:
            acc = gl.reshape(acc, [4, 4, 2, 2, 2, 2, 2, BH])  # m = (m8 m7 | m6 m5 | m4 | m3 | m2 | m1 | m0)
            # column = (c8 c7 = m6 m5 | c6 = m1 | c5 = m4 | c4 = m2 | c3 = m0 | c2 c1 = m8 m7 | c0 = m3)
            acc = gl.permute(acc, (1, 5, 2, 4, 6, 0, 3, 7))
        return gl.reshape(acc, [512, BH])

    @gluon.jit
    def _issue(descs, ring, split, tile, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr):
        """TMA of tile ``tile`` of this split (if it exists) into its ring slot. The partial last tile
        comes through the tail descriptors, whose rows end at the request's end: TMA fills the rest
        of the box with zeros, so stale bytes (even NaN) past the end never reach shared memory."""
        ckv_desc, kpe_desc, ckv_tail, kpe_tail = descs
        ckv_ring, kpe_ring, bars = ring
        kv_indices_ptr, page_base, start, end, n_full, n_tiles = split
        if tile < n_tiles:
            slot = tile % NUM_STAGES
            bar = bars.index(slot)
            mbarrier.expect(bar, 64 * 576)
            if tile < n_full:
                n0 = start + tile * 64
                row = gl.load(kv_indices_ptr + page_base + n0 // PAGE) * PAGE + n0 % PAGE
                tma.async_copy_global_to_shared(ckv_desc, [row, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_desc, [row, 0], bar, kpe_ring.index(slot))
            else:
                tma.async_copy_global_to_shared(ckv_tail, [0, 0], bar, ckv_ring.index(slot))
                tma.async_copy_global_to_shared(kpe_tail, [0, 0], bar, kpe_ring.index(slot))

    @triton.constexpr_function
    def _slot_entries(num_stages):
        """Sparse with a slot ring: tile t's slots sit in ring entry t % this, written NUM_STAGES tiles
        before its rows are gathered and read until its softmax, while the gathers run NUM_STAGES ahead."""
        return 2 * num_stages + 1

    @gluon.jit
    def _fetch_slots(split, tile, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Sparse: tile ``tile``'s 64 token slots into the slot ring by cp.async (positions past the
        split's end arrive as zeros: the readers mask them by position). No commit."""
        tok_ptr, start, end, n_tiles, toks = split[0], split[2], split[3], split[5], split[6]
        if tile < n_tiles:
            sl: gl.constexpr = gl.BlockedLayout([4], [32], [NUM_WARPS], [0])
            n = start + tile * 64 + gl.arange(0, 64, layout=sl)
            async_copy.async_copy_global_to_shared(toks.index(tile % _slot_entries(NUM_STAGES)), tok_ptr + n,
                                                   mask=n < end)

    @gluon.jit
    def _first_slots(split, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Sparse with a slot ring: the first NUM_STAGES tiles' slots, waited for, before their gathers."""
        for i in gl.static_range(NUM_STAGES):
            _fetch_slots(split, i, NUM_STAGES, NUM_WARPS)
        async_copy.commit_group()
        async_copy.wait_group(0)
        _cta_barrier()

    @gluon.jit
    def _tile_slots(split, tile, layout: gl.constexpr, NUM_STAGES: gl.constexpr):
        """[64] tile ``tile``'s slots in ``layout``, -1 past the split's end: from the slot ring
        (``SLOT_RING``) or from global memory."""
        start, end = split[2], split[3]
        n = start + tile * 64 + gl.arange(0, 64, layout=layout)
        if len(split) > 6:  # the slot ring (SLOT_RING)
            return gl.where(n < end, split[6].index(tile % _slot_entries(NUM_STAGES)).load(layout), -1)
        return gl.load(split[0] + n, mask=n < end, other=-1)

    @gluon.jit
    def _gather(ring, split, tile, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Sparse: the 576-byte rows of tile ``tile``'s 64 token slots by cp.async (16 bytes a thread a
        copy; TMA has no row gather) into its ring slot; a -1 slot or one past the split's end is
        zero-filled. With a slot ring (SLOT_RING) the slots come from shared memory, fetched NUM_STAGES
        tiles earlier (with this call's rows: tile + NUM_STAGES's), so that no global load waits in
        the tile chain. One commit group per call, empty past the last tile, so the groups count tiles."""
        kv_ptr, n_tiles = split[1], split[5]
        ckv_ring, kpe_ring = ring[0], ring[1]
        if tile < n_tiles:
            slot = tile % NUM_STAGES
            cl: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NUM_WARPS, 1], [1, 0])  # a warp: one 512 B row
            pl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0])  # a warp: 8 rows of 64 B
            t = _tile_slots(split, tile, gl.SliceLayout(1, cl), NUM_STAGES)
            c = gl.arange(0, 512, layout=gl.SliceLayout(0, cl))
            async_copy.async_copy_global_to_shared(ckv_ring.index(slot), kv_ptr + t.to(gl.int64)[:, None] * 576
                                                   + c[None, :], mask=(t >= 0)[:, None])
            t = _tile_slots(split, tile, gl.SliceLayout(1, pl), NUM_STAGES)
            c = gl.arange(0, 64, layout=gl.SliceLayout(0, pl))
            async_copy.async_copy_global_to_shared(kpe_ring.index(slot), kv_ptr + 512 + t.to(gl.int64)[:, None] * 576
                                                   + c[None, :], mask=(t >= 0)[:, None])
            if len(split) > 6:  # the slot ring (SLOT_RING)
                _fetch_slots(split, tile + NUM_STAGES, NUM_STAGES, NUM_WARPS)
        async_copy.commit_group()

    @gluon.jit
    def _store_p(p_smem, p, T0, SPLIT: gl.constexpr):
        """p [64, BLOCK_H] (at most 1) into e4m3 p^T at p_smem's term T0: x P_SCALE, or (SPLIT) two
        terms of 16 (16 p), so that the MMAs give 256 p either way."""
        if SPLIT:
            _store_split(p_smem, _relabel_p(p * 16.0), True, 0, T0)
        else:
            _store_split(p_smem, _relabel_p(p * _P_SCALE), False, 0, T0)

    @gluon.jit
    def _pv_mma(v, p_smem, T0, acc, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """acc += V^T @ p^T, issued: V [64, 512] e4m3 relabelled in registers as the A operand, p^T
        from p_smem's term T0 (SPLIT: and T0 + 1; 1 or 2 wgmma groups)."""
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=4)
        vt = _relabel_v(v, a_layout, NUM_WARPS)
        acc = warpgroup_mma(vt, p_smem.index(T0).permute((1, 0)), acc, is_async=True)
        if SPLIT:
            acc = warpgroup_mma(vt, p_smem.index(T0 + 1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _pv(p, alpha, v, acc, p_smem, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """acc * alpha + V^T @ p^T, waited: p into shared memory (``_store_p``), then ``_pv_mma``."""
        _store_p(p_smem, p, 0, SPLIT)
        fence_async_shared()
        _cta_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, acc.type.layout))[None, :]  # all heads, 8 warps
        acc = _pv_mma(v, p_smem, 0, acc, NUM_WARPS, SPLIT)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    @gluon.jit
    def _refill(descs, ring, split, tile, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, NUM_WARPS: gl.constexpr,
                SPARSE: gl.constexpr):
        """Tile ``tile`` (if it exists) into its ring slot: rows by cp.async (sparse) or pages by TMA."""
        if SPARSE:
            _gather(ring, split, tile, NUM_STAGES, NUM_WARPS)
        else:
            _issue(descs, ring, split, tile, NUM_STAGES, PAGE)

    @gluon.jit
    def _tile(descs, ring, split, p_smem, qn_smem, qp_smem, tile, qk_scale, m_i, l_i, acc,
              MASKED: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
              NUM_WARPS: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr):
        """Online-softmax update of (m_i, l_i, acc = out^T) with tile ``tile``; refills its slot."""
        _wait_tile(ring, tile, NUM_STAGES, SPARSE, NUM_STAGES - 1)
        s = _issue_scores(ring, qn_smem, qp_smem, tile, NUM_STAGES, BLOCK_H, NUM_WARPS, SPLIT)
        v = ring[0].index(tile % NUM_STAGES).load(_v_layout(NUM_WARPS))  # [64, 512] e4m3, under the MMA
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        _cta_barrier()  # every warp is done with the slot: refill it
        _refill(descs, ring, split, tile + NUM_STAGES, NUM_STAGES, PAGE, NUM_WARPS, SPARSE)
        m_i, l_i, p, alpha = _online_softmax(s, split, tile, qk_scale, m_i, l_i, MASKED, SPARSE, NUM_STAGES, NUM_WARPS)
        return m_i, l_i, _pv(p, alpha, v, acc, p_smem, NUM_WARPS, SPLIT)

    @gluon.jit
    def _wait_tile(ring, tile, NUM_STAGES: gl.constexpr, SPARSE: gl.constexpr, PENDING: gl.constexpr):
        """Until tile ``tile`` is in its ring slot: its TMA barrier; or (sparse) at most PENDING of the
        later cp.async groups still pending, then everyone's copies visible to the MMA."""
        if SPARSE:
            async_copy.wait_group(PENDING)
            fence_async_shared()
            _cta_barrier()
        else:
            mbarrier.wait(ring[2].index(tile % NUM_STAGES), (tile // NUM_STAGES) & 1)

    @gluon.jit
    def _issue_scores(ring, qn_smem, qp_smem, tile, NUM_STAGES: gl.constexpr, BLOCK_H: gl.constexpr,
                      NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """s^T [64, BLOCK_H] = K @ q^T of tile ``tile``, issued (2 wgmma groups; SPLIT: 4)."""
        s_layout: gl.constexpr = _s_layout(NUM_WARPS, BLOCK_H)
        ckv = ring[0].index(tile % NUM_STAGES)
        kpe = ring[1].index(tile % NUM_STAGES)
        s = warpgroup_mma(ckv, qn_smem.index(0).permute((1, 0)), gl.zeros([64, BLOCK_H], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(kpe, qp_smem.index(0).permute((1, 0)), s, is_async=True)
        if SPLIT:
            s = warpgroup_mma(ckv, qn_smem.index(1).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(kpe, qp_smem.index(1).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _online_softmax(s, split, tile, qk_scale, m_i, l_i, MASKED: gl.constexpr, SPARSE: gl.constexpr,
                        NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Scores of tile ``tile`` -> (m_new, l_i, p, alpha): the running max and per-row sums updated,
        p = exp2(s - m_new) (at most 1), alpha the old terms' rescale."""
        s = s * qk_scale
        if MASKED:  # rows past the split's end (zeros from the tail descriptor), sparse -1 slots: -inf
            if SPARSE:  # -1 past the end too
                valid = _tile_slots(split, tile, gl.SliceLayout(1, s.type.layout), NUM_STAGES) >= 0
            else:
                valid = split[2] + tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s.type.layout)) < split[3]
            s = gl.where(valid[:, None], s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # a sparse tile may have no valid slot yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        return m_new, l_i * alpha[None, :] + p, p, alpha

    @gluon.jit
    def _pv_issue(ring, p_smem, acc, tile, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """acc += V^T @ p^T of tile ``tile`` (V from its ring slot into registers, p from its buffer),
        issued (1 wgmma group; SPLIT: 2)."""
        NQ: gl.constexpr = 2 if SPLIT else 1
        v = ring[0].index(tile % NUM_STAGES).load(_v_layout(NUM_WARPS))
        return _pv_mma(v, p_smem, (tile % 2) * NQ, acc, NUM_WARPS, SPLIT)

    @gluon.jit
    def _pipe_step(descs, ring, split, p_smem, qn_smem, qp_smem, tile, qk_scale, m_i, l_i, acc,
                   HAS_PREV: gl.constexpr, MASKED: gl.constexpr, NUM_STAGES: gl.constexpr, PAGE: gl.constexpr,
                   BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr):
        """One tile of the pipelined loop: this tile's score MMA, then the previous tile's p @ V, both
        issued before this tile's softmax, which runs under the p @ V. On return acc holds every tile
        before this one (rescaled to the new maximum) and this tile's p is in its buffer."""
        NQ: gl.constexpr = 2 if SPLIT else 1
        # sparse: tiles up to tile + NUM_STAGES - 2 are committed (the previous slot's refill comes below)
        _wait_tile(ring, tile, NUM_STAGES, SPARSE, NUM_STAGES - 2 if HAS_PREV else NUM_STAGES - 1)
        s = _issue_scores(ring, qn_smem, qp_smem, tile, NUM_STAGES, BLOCK_H, NUM_WARPS, SPLIT)
        if HAS_PREV:
            acc = _pv_issue(ring, p_smem, acc, tile - 1, NUM_STAGES, NUM_WARPS, SPLIT)
            s = warpgroup_mma_wait(num_outstanding=NQ, deps=(s, ))  # the scores retire, p @ V runs on
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        m_i, l_i, p, alpha = _online_softmax(s, split, tile, qk_scale, m_i, l_i, MASKED, SPARSE, NUM_STAGES, NUM_WARPS)
        _store_p(p_smem, p, (tile % 2) * NQ, SPLIT)  # two buffers: the previous p @ V reads the other one
        if HAS_PREV:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, acc.type.layout))[None, :]
        fence_async_shared()
        _cta_barrier()  # p is visible to the next p @ V; every warp has read the previous slot's V
        if HAS_PREV:  # refill the previous tile's slot
            _refill(descs, ring, split, tile - 1 + NUM_STAGES, NUM_STAGES, PAGE, NUM_WARPS, SPARSE)
        return m_i, l_i, acc

    @gluon.jit
    def _gather_ds(ring, ds_ring, split, tile, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
        """``_gather`` for 656-byte fp8_ds_mla rows: 512 e4m3 NoPE values into the ckv ring, the 64
        bf16 RoPE values and the 4 fp32 group scales into their own rings (-1 slots: zeros)."""
        tok_ptr, ptrs, start, end, n_full, n_tiles = split
        kv_ptr, rope_ptr, scale_ptr = ptrs  # e4m3, bf16 and fp32 views of the same rows
        if tile < n_tiles:
            slot = tile % NUM_STAGES
            cl: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NUM_WARPS, 1], [1, 0])  # a warp: one row
            rl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])  # a warp: 4 rows of 128 B
            if NUM_WARPS == 4:  # [64, 4] fp32: 8 bytes a thread
                sl: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [NUM_WARPS, 1], [1, 0])
            else:
                sl: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [NUM_WARPS, 1], [1, 0])
            n = start + tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, cl))
            t = gl.load(tok_ptr + n, mask=n < end, other=-1)
            c = gl.arange(0, 512, layout=gl.SliceLayout(0, cl))
            async_copy.async_copy_global_to_shared(ring[0].index(slot), kv_ptr + t.to(gl.int64)[:, None] * DS_ROW
                                                   + c[None, :], mask=(t >= 0)[:, None])
            n = start + tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, rl))
            t = gl.load(tok_ptr + n, mask=n < end, other=-1)
            c = gl.arange(0, 64, layout=gl.SliceLayout(0, rl))
            async_copy.async_copy_global_to_shared(ds_ring[0].index(slot), rope_ptr + DS_ROPE_AT_BF16
                                                   + t.to(gl.int64)[:, None] * DS_ROW_BF16 + c[None, :],
                                                   mask=(t >= 0)[:, None])
            n = start + tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, sl))
            t = gl.load(tok_ptr + n, mask=n < end, other=-1)
            c = gl.arange(0, 4, layout=gl.SliceLayout(0, sl))
            async_copy.async_copy_global_to_shared(ds_ring[1].index(slot), scale_ptr + DS_SCALE_AT_F32
                                                   + t.to(gl.int64)[:, None] * DS_ROW_F32 + c[None, :],
                                                   mask=(t >= 0)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _group_col(x, g: gl.constexpr, layout: gl.constexpr):
        """Column g of x [64, 4] as a [64] vector in ``layout``."""
        col = gl.arange(0, 4, layout=gl.SliceLayout(0, x.type.layout))
        return gl.convert_layout(gl.sum(gl.where(col[None, :] == g, x, 0.0), axis=1), layout)

    @gluon.jit
    def _ds_ratio(sc):
        """sc [64, 4] group scales -> each token's largest (0: no token) and every group's ratio to it."""
        top = gl.max(sc, axis=1)
        return top, gl.where(top[:, None] > 0, sc / gl.maximum(top, 1e-30)[:, None], 0.0)

    @gluon.jit
    def _issue_rope(rope, qr_smem, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr):
        """fp8_ds_mla: the RoPE scores, rope [64, 64] bf16 tile @ q_pe^T (a BF16 MMA, k 16), issued."""
        r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                           instr_shape=[16, BLOCK_H * 4 // NUM_WARPS, 16])
        return warpgroup_mma(rope, qr_smem.permute((1, 0)), gl.zeros([64, BLOCK_H], gl.float32, r_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _ds_rescale_smem(ckv, sc, NUM_WARPS: gl.constexpr):
        """fp8_ds_mla: ckv [64, 512] e4m3 in shared memory, sc [64, 4] its tokens' fp32 group scales:
        every group brought to its token's largest scale in place (x 2^-k: exact unless a value drops
        into e4m3's subnormals), so that one scale per token (a row of the scores, a k of p @ V)
        remains. One 128-column group at a time, few registers live: the whole tile in fp16 beside
        the output accumulator spilled (run 17e: 1.6-1.9x slower)."""
        g_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])  # [64, 128]
        s4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        _top, ratio = _ds_ratio(sc.load(s4))
        for i in gl.static_range(4):
            r = _group_col(ratio, i, gl.SliceLayout(1, g_layout))
            part = ckv.slice(i * 128, 128, dim=1)
            x = part.load(g_layout)
            part.store((x.to(gl.float16) * r.to(gl.float16)[:, None]).to(gl.float8e4nv))

    @gluon.jit
    def _tile_ds(ring, ds_ring, split, p_smem, qn_smem, qr_smem, tile, qk_scale, qk_rope, m_i, l_i, acc,
                 NUM_STAGES: gl.constexpr, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """``_tile`` on fp8_ds_mla rows (sparse): V rescaled to one scale per token and written back;
        scores = tok_scale * (ckv . q) + rope . q_pe (a BF16 MMA); p @ V takes p * tok_scale, so the
        running maximum is that of scores + log2(tok_scale) (the sum l stays that of p)."""
        s_layout: gl.constexpr = _s_layout(NUM_WARPS, BLOCK_H)
        slot = tile % NUM_STAGES
        async_copy.wait_group(NUM_STAGES - 1)
        fence_async_shared()
        _cta_barrier()
        ckv = ring[0].index(slot)
        _ds_rescale_smem(ckv, ds_ring[1].index(slot), NUM_WARPS)
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(ckv, qn_smem.index(0).permute((1, 0)), gl.zeros([64, BLOCK_H], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        if SPLIT:
            s = warpgroup_mma(ckv, qn_smem.index(1).permute((1, 0)), s, is_async=True)
        r = _issue_rope(ds_ring[0].index(slot), qr_smem, BLOCK_H, NUM_WARPS)
        v = ckv.load(_v_layout(NUM_WARPS))  # [64, 512] e4m3, rescaled, under the MMAs
        # the token's largest group scale again, from shared memory (registers are what this kernel lacks)
        tl: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        tok_scale = gl.convert_layout(gl.max(ds_ring[1].index(slot).load(tl), axis=1), gl.SliceLayout(1, s_layout))
        s, r = warpgroup_mma_wait(num_outstanding=0, deps=(s, r))
        _cta_barrier()  # every warp is done with the slot: refill it
        _gather_ds(ring, ds_ring, split, tile + NUM_STAGES, NUM_STAGES, NUM_WARPS)

        s = s * (qk_scale * tok_scale)[:, None] + gl.convert_layout(r, s_layout) * qk_rope
        # -1 slots and rows past the split's end arrive as zeros (the copies' zero fill), and a stored
        # row's scales are > 0 (kvlayout clamps amax): no slot load in the chain for the mask
        return _ds_softmax_pv(s, tok_scale, m_i, l_i, v, acc, p_smem, NUM_WARPS, SPLIT)

    @gluon.jit
    def _ds_softmax_pv(s, tok_scale, m_i, l_i, v, acc, p_smem, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
        """fp8_ds_mla: the online-softmax update from the scaled scores s [64, BLOCK_H] and each token's
        largest group scale (0: no token), then p @ V with V at that scale: the running max is over
        s + log2(tok_scale), p carries the token scale, l sums the plain p."""
        valid = tok_scale > 0
        s = gl.where(valid[:, None], s, -float("inf"))
        w = s + gl.where(valid, gl.log2(gl.maximum(tok_scale, 1e-30)), 0.0)[:, None]
        m_new = gl.maximum(m_i, gl.max(w, axis=0))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(w - m_use[None, :])  # p * tok_scale, at most 1
        l_i = l_i * alpha[None, :] + gl.exp2(s - m_use[None, :])
        return m_new, l_i, _pv(p, alpha, v, acc, p_smem, NUM_WARPS, SPLIT)

    @gluon.jit(do_not_specialize=["H", "num_splits"])
    def _mla_decode_fp8_gluon_kernel(
        q_nope_ptr,  # *[B, H, 512] bf16/fp16, last dim contiguous
        q_pe_ptr,  # *[B, H, 64]
        kv_ptr,  # *fp8e4nv [num_pages, PAGE, 576], dense: num_rows token rows of 576 bytes (DS: 656)
        rope_ptr,  # DS: *bf16 view of the same rows (328 a row); else unused
        scale_ptr,  # DS: *fp32 view of the same rows (164 a row); else unused
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
        BLOCK_H: gl.constexpr,  # heads per CTA: 16 or 32 (the MMAs' N), 64 with 8 warps
        DIRECT: gl.constexpr,  # one split: write the final output and natural-log lse
        NUM_STAGES: gl.constexpr,  # tiles in the shared-memory ring
        NUM_WARPS: gl.constexpr,  # = num_warps: 4 (one warpgroup), or 8 for BLOCK_H = 64
        SPARSE: gl.constexpr,  # attend to the slots in tok_ptr (rows by cp.async) instead of the pages
        SPLIT: gl.constexpr,  # accurate: q and p each as two e4m3 terms (twice the MMAs, V unchanged)
        DS: gl.constexpr = False,  # SPARSE on fp8_ds_mla rows (656 B: 512 e4m3, 4 fp32 scales, 64 bf16)
        PIPE: gl.constexpr = 0,  # the pipelined loop (_pipe_step)
        SLOT_RING: gl.constexpr = False,  # SPARSE, not DS: the slots by cp.async into a shared-memory ring
    ):
        hblk = gl.program_id(0)  # head blocks fastest: a request's blocks run side by side and share its rows in L2
        b = gl.program_id(1)
        split = gl.program_id(2)
        s_layout: gl.constexpr = _s_layout(NUM_WARPS, BLOCK_H)
        acc_layout: gl.constexpr = _acc_layout(NUM_WARPS, BLOCK_H)
        ckv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [NUM_WARPS, 1], [1, 0])

        ckv_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 512], ckv_sl)
        if DS:  # RoPE stays BF16 (a BF16 MMA with a BF16 q_pe); the group scales beside it
            rope_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            ds_ring = (gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, 64], rope_sl),
                       gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 64, 4],
                                                 gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])))
            kpe_ring = ckv_ring  # unused
        else:
            kpe_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 64, 64], kpe_sl)
        NQ: gl.constexpr = 2 if SPLIT else 1  # e4m3 terms of q and of p
        qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [NQ, BLOCK_H, 512], ckv_sl)
        if DS:
            qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], rope_sl)
        else:
            qp_smem = gl.allocate_shared_memory(gl.float8e4nv, [NQ, BLOCK_H, 64], kpe_sl)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * NQ if PIPE else NQ, BLOCK_H, 64], kpe_sl)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)

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
        ring = (ckv_ring, kpe_ring, bars)
        if DS:
            split_ = (tok_ptr + b.to(gl.int64) * topk, (kv_ptr, rope_ptr, scale_ptr), start, end, 0, n_tiles)
            for i in gl.static_range(NUM_STAGES):
                _gather_ds(ring, ds_ring, split_, i, NUM_STAGES, NUM_WARPS)
        elif SPARSE:
            descs = (kv_ptr, kv_ptr, kv_ptr, kv_ptr)  # unused: rows come by cp.async
            split_ = (tok_ptr + b.to(gl.int64) * topk, kv_ptr, start, end, 0, n_tiles)
            if SLOT_RING:
                toks = gl.allocate_shared_memory(gl.int32, [_slot_entries(NUM_STAGES), 64],
                                                 gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
                split_ = split_ + (toks, )
                _first_slots(split_, NUM_STAGES, NUM_WARPS)
            for i in gl.static_range(NUM_STAGES):
                _gather(ring, split_, i, NUM_STAGES, NUM_WARPS)
        else:
            # TMA descriptors: the whole pool as token rows; and the rows of the partial last tile (if
            # any) up to the request's end, so that the box past it reads as zeros
            ckv_desc = tma.make_tensor_descriptor(kv_ptr, [num_rows, 512], [576, 1], [64, 512], ckv_sl)
            kpe_desc = tma.make_tensor_descriptor(kv_ptr + 512, [num_rows, 64], [576, 1], [64, 64], kpe_sl)
            if n_full < n_tiles:
                n0_tail = start + n_full * 64
                tail_row = gl.load(kv_indices_ptr + page_base + n0_tail // PAGE) * PAGE + n0_tail % PAGE
                tail_ptr = kv_ptr + tail_row.to(gl.int64) * 576
                ckv_tail = tma.make_tensor_descriptor(tail_ptr, [end - n0_tail, 512], [576, 1], [64, 512], ckv_sl)
                kpe_tail = tma.make_tensor_descriptor(tail_ptr + 512, [end - n0_tail, 64], [576, 1], [64, 64], kpe_sl)
            else:  # no partial tile: no descriptors to build (each costs a global write and a fence)
                ckv_tail = ckv_desc
                kpe_tail = kpe_desc
            descs = (ckv_desc, kpe_desc, ckv_tail, kpe_tail)
            split_ = (kv_indices_ptr, page_base, start, end, n_full, n_tiles)
            for i in gl.static_range(NUM_STAGES):
                _issue(descs, ring, split_, i, NUM_STAGES, PAGE)


        # the query in e4m3, one scale for the CTA (amax / 448), into shared memory (the B operands)
        heads = hblk * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
        hmask = (heads < H)[:, None]
        qn_ptrs = q_nope_ptr + b * stride_qn_b + heads[:, None] * stride_qn_h
        qp_ptrs = q_pe_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h
        if DS:  # q_pe meets the BF16 RoPE in a BF16 MMA: only q_nope is scaled to e4m3
            amax = gl.zeros([], gl.float32)
        else:
            amax = gl.max(gl.max(gl.abs(_load_q(qp_ptrs, hmask, 0, 64, q_layout)), axis=1), axis=0)
        QW: gl.constexpr = 128 if SPLIT else 512  # SPLIT: two passes of 128 columns, max |q| then the stores
        for c0 in gl.static_range(0, 512, QW):
            amax = gl.maximum(amax, gl.max(gl.max(gl.abs(_load_q(qn_ptrs, hmask, c0, QW, q_layout)), axis=1), axis=0))
        if SPLIT:  # |q / q_sc| <= 28: 16 hi stays within e4m3's 448; the MMAs then give 16 q.k
            q_sc = gl.maximum(amax, 1e-12) / 28.0
        else:
            q_sc = gl.maximum(amax, 1e-12) / 448.0
        for c0 in gl.static_range(0, 512, QW):
            _store_split(qn_smem, _load_q(qn_ptrs, hmask, c0, QW, q_layout) / q_sc, SPLIT, c0)
        if DS:
            qr_smem.store(_load_q(qp_ptrs, hmask, 0, 64, q_layout).to(gl.bfloat16))
        else:
            _store_split(qp_smem, _load_q(qp_ptrs, hmask, 0, 64, q_layout) / q_sc, SPLIT)
        fence_async_shared()
        _cta_barrier()
        qk_rope = qk_scale  # DS: the BF16 q_pe is not scaled
        if SPLIT:
            qk_scale = qk_scale * q_sc * 0.0625
        else:
            qk_scale = qk_scale * q_sc

        m_i = gl.full([BLOCK_H], -float("inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
        l_i = gl.zeros([64, BLOCK_H], gl.float32, layout=s_layout)
        acc = gl.zeros([512, BLOCK_H], gl.float32, layout=acc_layout)  # out^T, rows relabelled
        if DS:
            for tile in range(0, n_tiles):
                m_i, l_i, acc = _tile_ds(ring, ds_ring, split_, p_smem, qn_smem, qr_smem, tile, qk_scale,
                                         qk_rope, m_i, l_i, acc, NUM_STAGES, BLOCK_H, NUM_WARPS, SPLIT)
            async_copy.wait_group(0)
        elif PIPE:  # the first and last tiles always masked (a full one loses nothing); sparse: every tile
            if n_tiles > 0:
                m_i, l_i, acc = _pipe_step(descs, ring, split_, p_smem, qn_smem, qp_smem, 0, qk_scale, m_i, l_i, acc,
                                           False, True, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS, SPARSE, SPLIT)
                for tile in range(1, n_tiles - 1):
                    m_i, l_i, acc = _pipe_step(descs, ring, split_, p_smem, qn_smem, qp_smem, tile, qk_scale, m_i,
                                               l_i, acc, True, SPARSE, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS, SPARSE,
                                               SPLIT)
                if n_tiles > 1:
                    m_i, l_i, acc = _pipe_step(descs, ring, split_, p_smem, qn_smem, qp_smem, n_tiles - 1, qk_scale,
                                               m_i, l_i, acc, True, True, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS,
                                               SPARSE, SPLIT)
                acc = _pv_issue(ring, p_smem, acc, n_tiles - 1, NUM_STAGES, NUM_WARPS, SPLIT)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if SPARSE:
                async_copy.wait_group(0)
        elif SPARSE:  # every tile masked: any slot may be -1
            for tile in range(0, n_tiles):
                m_i, l_i, acc = _tile(descs, ring, split_, p_smem, qn_smem, qp_smem, tile, qk_scale, m_i, l_i, acc,
                                      True, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS, True, SPLIT)
            async_copy.wait_group(0)
        else:
            for tile in range(0, n_full):
                m_i, l_i, acc = _tile(descs, ring, split_, p_smem, qn_smem, qp_smem, tile, qk_scale, m_i, l_i, acc,
                                      False, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS, False, SPLIT)
            if n_full < n_tiles:  # the split's partial last tile, masked
                m_i, l_i, acc = _tile(descs, ring, split_, p_smem, qn_smem, qp_smem, n_full, qk_scale, m_i, l_i,
                                      acc, True, NUM_STAGES, PAGE, BLOCK_H, NUM_WARPS, False, SPLIT)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        # out^T back to [512 columns, BLOCK_H] in column order (free), then through shared memory
        # to a layout that writes 16 contiguous bytes a thread: the partials are one write of
        # B*H*S*512*4 B, and scattered 4-byte stores would cost several times that in sectors
        o_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NUM_WARPS], [0, 1])
        out = gl.convert_layout(_unrelabel_acc(acc, NUM_WARPS), o_layout)
        l_i = gl.convert_layout(gl.sum(l_i, axis=0), gl.SliceLayout(0, o_layout))
        m_i = gl.convert_layout(m_i, gl.SliceLayout(0, o_layout))
        l_safe = gl.maximum(l_i, 1e-30)
        inv = gl.where(l_i > 0, 1.0 / (l_safe * _P_SCALE), 0.0)
        col = gl.arange(0, 512, layout=gl.SliceLayout(1, o_layout))
        h_o = hblk * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, o_layout))
        hmask_o = (h_o < H)[None, :]
        if DIRECT:
            out = out * (inv * out_scale)[None, :]
            ptrs = o_ptr + b * stride_o_b + h_o[None, :] * stride_o_h + col[:, None]
            gl.store(ptrs, out.to(o_ptr.dtype.element_ty), mask=hmask_o)
            lse = gl.where(l_i > 0, (m_i + gl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
            gl.store(lse_ptr + b * H + h_o, lse, mask=h_o < H)
        else:
            row_o = (b * H + h_o) * num_splits + split
            gl.store(o_ptr + row_o[None, :] * 512 + col[:, None], (out * inv[None, :]).to(o_ptr.dtype.element_ty), mask=hmask_o)
            lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), -float("inf"))
            gl.store(lse_ptr + row_o, lse2, mask=h_o < H)


def _scratch(size: int, alignment: int, stream):
    """Global scratch for descriptors built on the device (Triton asks its allocator for it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# Measured on the H200 (scripts/gpu_gluon.py -> data/kernels/h200_run4c_gluon.*, CUDA-graph medians):
# two CTAs per SM with a 2-tile ring each was best at 16 heads 128 x 8K, 32 x 32K, 8 heads 128 x 16K
# and 32 heads, and within 3% of the best (one CTA, 2-3 tiles) at 64 x 8K.
# min_tiles / max_splits: the fewest tiles a split holds and the most splits a request gets when the
# wave leaves room for more (default_num_splits).
GPU_CONFIG = dict(num_stages=2, ctas_per_sm=2, min_tiles=4, max_splits=64, pipeline=False)
# 64 heads a CTA (8 warps, 144 KB of shared memory at 3 stages): one CTA per SM. A split may hold one
# tile: at one request of 8K, 64 heads, 128 splits (one tile each) against 32 took accurate 36.0 us
# against 42.7 and fast 19.3 against 22.9 (run 11a, gpu_gluon.py --accurate); at 128 heads (two head
# blocks) 64 splits 42.2 against 43.3, and 128 (two waves) 83.6.
GPU_CONFIG_WIDE = dict(num_stages=3, ctas_per_sm=1, min_tiles=1, max_splits=128, pipeline=False)


# 17-32 heads a CTA, fast: the pipelined tile loop (run 12c, gpu_gluon.py, 32 heads 64 x 8K: 167.5 -> 129.6
# us; its 4-warp CTA spills either way, 284 bytes against 476). Accurate there it took 397 us against
# 245 (run 11d), and at 16 and 64 heads it was slower in both precisions (fast 89.2 -> 96.6 and
# 151.4 -> 168.8 us): off.
GPU_CONFIG_32 = dict(GPU_CONFIG, pipeline=True)
BLOCK_HS = (16, 32, WIDE_HEADS)  # heads a CTA: one warpgroup of 16 or 32, two warpgroups of 64
# 16-32 heads on two warpgroups (``num_warps=8``): the scores split the heads, p @ V the 512 rows, so a
# thread holds half the accumulator and half of V. sm_90 SASS (Triton 3.7.1 here): 32 heads fast 170
# registers and no stack against 255 and 256 bytes (sparse) / 168 (the pipelined dense loop) on one
# warpgroup; accurate 208 and none against 464; fp8_ds_mla rows 196 and none against 256; 16 heads
# accurate 167 and none against 112. One CTA an SM (so three stages).
GPU_CONFIG_TWO_WG = dict(GPU_CONFIG_WIDE)
# Two warpgroups are the default for 32-head blocks and for sparse accurate 16-head ones (run 18a,
# H100, gpu_gluon.py, CUDA-graph us, 4 -> 8 warps): fast 32 heads 64 x 8K 139.3 -> 119.0; sparse
# top-2048 of 32K, 64 requests, 32 heads 74.8 -> 45.7; accurate 32 heads 64 x 8K 257.1 -> 167.6. Run 21
# (H100, both orders) repeats those and the sparse accurate 16-head one (59.7 -> 54.3), but not run 18a's
# fast 16-head gains (128 x 8K 246.1 -> 212.5, 32 x 32K 239.4 -> 215.2): whatever gpu_gluon.py timed
# first after a shape's float64 reference ran up to 16% slow, and 18a timed 4 warps first. Side by side
# after a discarded timing: 16 heads 128 x 8K 223.0 / 222.5 (4 / 8 warps), 32 x 32K 223.2 / 227.0, 64 x
# 8K 119.7 / 119.9, sparse 43.8 / 42.0; on the H200 the bench had 16 heads 64 x 8K at 85.6 us with 4
# warps (17c) and 96.8 with 8 (21a), sparse 34.9 and 39.3, FlashInfer alike in both (147 and 59.5 us).
# So fast and dense accurate 16-head blocks take one warpgroup (two CTAs an SM). fp8_ds_mla rows (run
# 18b probe, 64 x top-2048 of 32K, 8 -> 4 warps): 16 heads fast 66.3 -> 53.4, accurate 79.8 -> 71.9,
# but 32 heads fast 73.3 -> 90.4.


def default_warps(block_h: int, precision: str = "fast", sparse: bool = False, ds: bool = False) -> int:
    """Warps a CTA for a ``block_h`` head block when the caller names none (see above)."""
    if block_h == WIDE_HEADS:
        return 8
    if block_h == 16:
        return 8 if precision == "accurate" and sparse and not ds else 4
    return 8


def block_config(H: int, block_h: int | None = None, num_warps: int | None = None, precision: str = "fast",
                 sparse: bool = False, ds: bool = False) -> tuple[int, int, dict]:
    """(BLOCK_H, num_warps, GPU_CONFIG) for H heads: a block of 16 or 32 heads up to 32, else 64 heads on
    two warpgroups (128 heads: two head blocks of 64, each CTA reading the same pages). ``block_h``
    forces one (16, 32 or 64); ``num_warps`` 4 or 8 puts a 16- or 32-head block on one or two
    warpgroups (None: ``default_warps`` for ``precision``, ``sparse`` and fp8_ds_mla rows ``ds``)."""
    if block_h is None:
        block_h = 16 if H <= 16 else 32 if H <= 32 else WIDE_HEADS
    if block_h not in BLOCK_HS:
        raise ValueError(f"mla_decode_fp8_gluon: block_h={block_h!r}; allowed {list(BLOCK_HS)}")
    if num_warps not in (None, 4, 8) or (block_h == WIDE_HEADS and num_warps == 4):
        raise ValueError(f"mla_decode_fp8_gluon: num_warps={num_warps!r}; allowed 4 or 8 at block_h 16-32, "
                         f"8 at {WIDE_HEADS} (block_h={block_h})")
    if num_warps is None:
        num_warps = default_warps(block_h, precision, sparse, ds)
    if block_h == WIDE_HEADS:
        return WIDE_HEADS, 8, GPU_CONFIG_WIDE
    if num_warps == 8:
        return block_h, 8, GPU_CONFIG_TWO_WG
    return block_h, 4, GPU_CONFIG if block_h == 16 else GPU_CONFIG_32


def use_slot_ring(sparse: bool, ds: bool, num_warps: int, slot_ring: bool | None = None,
                  precision: str = "fast") -> bool:
    """Whether a sparse launch on per-tensor rows takes its slots through the shared-memory ring:
    ``slot_ring``, else where the CTA has ``SLOT_RING_WARPS`` warps or the precision is fast (see
    ``SLOT_RING_WARPS``). ValueError where there are no slots to ring (dense) or the rows are
    fp8_ds_mla (their own gather)."""
    if slot_ring and (not sparse or ds):
        raise ValueError(f"mla_decode_fp8_gluon: slot_ring=True needs sparse slots on fp8_per_tensor rows "
                         f"(sparse={sparse}, fp8_ds_mla={ds})")
    if slot_ring is None:
        return sparse and not ds and (num_warps == SLOT_RING_WARPS or precision == "fast")
    return bool(slot_ring)


def use_pipeline(cfg: dict, block_h: int, sparse: bool, ds: bool, precision: str = "fast",
                 pipeline: bool | None = None) -> bool:
    """Whether the launch takes the pipelined tile loop: ``pipeline``, or the config's default for the
    fast precision where the loop exists (not on fp8_ds_mla rows; not on sparse slots with one
    warpgroup: Triton 3.6-3.7 cannot prove the 16-byte alignment of its row copies there; not with a
    one-tile ring). ValueError if asked for where it does not exist."""
    no = "fp8_ds_mla rows" if ds else "sparse slots at <= 32 heads" if sparse and block_h < WIDE_HEADS else None
    if pipeline and no:
        raise ValueError(f"mla_decode_fp8_gluon: pipeline=True is not built for {no}; use pipeline=False or None")
    if pipeline is None:
        return bool(cfg["pipeline"]) and precision == "fast" and not no and cfg["num_stages"] >= 2
    if pipeline and cfg["num_stages"] < 2:
        raise ValueError(f"mla_decode_fp8_gluon: pipeline=True needs num_stages >= 2, got {cfg['num_stages']}")
    return bool(pipeline)


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


# The accurate precision's longest split (tokens): measured on the H200 (gpu_gluon.py --accurate,
# 64 x 8K): 4096-token splits gave 2.2-2.6e-3 at 16-64 heads, 8192-token ones 3.7e-3 at 128 heads.
ACCURATE_SPLIT_LEN = 4096


def capped_splits(num_splits: int, seq_len: int, precision: str, max_split_len: int | None = None) -> int:
    """``num_splits`` raised so that no split holds more than ``max_split_len`` tokens (default
    ``ACCURATE_SPLIT_LEN`` for the accurate precision, no cap for the fast one)."""
    if max_split_len is None:
        max_split_len = ACCURATE_SPLIT_LEN if precision == "accurate" else 0
    if max_split_len <= 0:
        return num_splits
    return max(num_splits, triton.cdiv(seq_len, max_split_len))


# The split partials' dtype per precision. bf16 partials halve the bytes a split writes and the
# merge reads (B*H*S*512*2 B each way; 16.8 MB of fp32 at 128 heads, one request, 64 splits) and
# round each split's output once more (2^-9 relative), far under the fast precision's 2.8e-2.
# Measured on an H100 (run 15, gpu_gluon.py, CUDA-graph us, fp32 -> bf16): one request of 8K 20.7 ->
# 17.6 at 64 heads, 24.2 -> 21.1 at 128; 16 heads 64 x 8K 134.8 -> 114.3; 64 heads 64 x 8K 154.3 ->
# 151.5; no shape slower by more than 0.6 us. Accurate keeps fp32 (its budget is 3e-3).
PART_DTYPE = {"fast": torch.bfloat16, "accurate": torch.float32}
# With bf16 partials a one-tile split costs less: fast at 16-32 heads may take splits of one tile, up to
# 128 a request, as the 64-head config does (16 heads, one request of 8K: 32 splits 14.5 us, 128 splits
# 10.8; H100, run 15). Batched shapes fill the wave at a few splits and do not change.
FAST_SPLITS = dict(min_tiles=1, max_splits=128)


def split_rule(cfg: dict, precision: str) -> dict:
    """``cfg`` with the fast precision's split bounds (``FAST_SPLITS``) where its partials are bf16."""
    return dict(cfg, **FAST_SPLITS) if PART_DTYPE[precision] == torch.bfloat16 else cfg


def part_dtype_for(precision: str, part_dtype: torch.dtype | None = None) -> torch.dtype:
    """The partials' dtype: ``part_dtype`` if given (float32 or bfloat16), else ``PART_DTYPE[precision]``."""
    if part_dtype is None:
        return PART_DTYPE[precision]
    if part_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"part_dtype={part_dtype}; allowed ['torch.float32', 'torch.bfloat16']")
    return part_dtype


KV_LAYOUTS = tuple(LAYOUT_ROW)  # fp8_ds_mla rows: e4m3 NoPE at 0, fp32 scales at byte 512, bf16 RoPE at 528


def check_ds_args(kv_buffer: torch.Tensor, kv_layout: str, sparse: bool, k_scale: float,
                  v_scale: float | None) -> bool:
    """Whether the rows are fp8_ds_mla (ValueError naming the rule if this call cannot read them)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"mla_decode_fp8_gluon: kv_layout={kv_layout!r}; allowed {list(KV_LAYOUTS)}")
    if kv_layout == "fp8_per_tensor":
        return False
    if not sparse:
        raise ValueError("mla_decode_fp8_gluon: kv_layout='fp8_ds_mla' is read for sparse batches only "
                         "(token_indices); dense pages of it: use mla_decode_fp8_rows")
    if kv_buffer.dtype != torch.uint8 or kv_buffer.dim() != 3 or kv_buffer.shape[-1] != 656:
        raise ValueError(f"mla_decode_fp8_gluon: fp8_ds_mla kv_buffer must be uint8 [num_pages, page_size, 656], "
                         f"got {kv_buffer.dtype} {tuple(kv_buffer.shape)}")
    if k_scale != 1.0 or v_scale not in (None, 1.0):
        raise ValueError(f"mla_decode_fp8_gluon: k_scale={k_scale}, v_scale={v_scale}; fp8_ds_mla rows carry "
                         f"their own scales (use 1.0)")
    return True


def check_gluon_args(H: int, page_size: int, device: torch.device, sparse: bool = False):
    """Why this kernel cannot run here (ValueError naming the rule), before any launch. Sparse
    batches read rows by id, so any page size; dense ones tile pages of 64 or 128."""
    if page_size % BLOCK_N and not sparse:
        raise ValueError(f"mla_decode_fp8_gluon: page_size={page_size}; allowed [64, 128] (a tile is 64 "
                         f"tokens of one page)")
    if H > MAX_HEADS:
        raise ValueError(f"mla_decode_fp8_gluon: {H} heads; allowed 1..{MAX_HEADS} (use mla_decode_fp8)")
    if not HAS_GLUON:
        raise ValueError(f"mla_decode_fp8_gluon: Triton {triton.__version__} has no Gluon TMA "
                         f"(triton.experimental.gluon, Triton >= 3.5)")
    if device.type != "cuda" or _capability(device.index) != (9, 0):
        raise ValueError(f"mla_decode_fp8_gluon: needs a Hopper GPU (sm_90: wgmma and TMA), got {device}; "
                         f"Gluon has no CPU interpreter")


def mla_decode_fp8_gluon(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_indices: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                         v_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False, *,
                         num_stages: int | None = None, ctas_per_sm: int | None = None, max_len: int | None = None,
                         token_indices: torch.Tensor | None = None, precision: str = "fast",
                         max_split_len: int | None = None, kv_layout: str = "fp8_per_tensor",
                         pipeline: bool | None = None, block_h: int | None = None,
                         part_dtype: torch.dtype | None = None, num_warps: int | None = None,
                         slot_ring: bool | None = None):
    """Paged absorbed-MLA decode over an FP8 e4m3 pool: TMA ring, FP8 wgmma for both products.

    Parameters
    ----------
    q_nope : [B, H, 512] bf16 or fp16 (H in 1..128), last dim contiguous.
    q_pe : [B, H, 64], same dtype.
    kv_buffer : [num_pages, page_size, 576] float8_e4m3fn, dense pages (stride(0) = page_size * 576),
        real = stored * k_scale; page_size 64 or 128 (any with ``token_indices``).
    kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 page ids; kv_lens : [B] int32.
    sm_scale : softmax scale. k_scale : per-tensor scale of the pool, folded into the scores.
    v_scale : scale of V, folded into the output; defaults to k_scale.
    num_splits : splits per request (None: one wave of ``ctas_per_sm`` CTAs per SM).
    return_lse : also return lse.
    token_indices : sparse: [B, topk] int32 token slots (global rows page * page_size + slot, -1 = none,
        checked where made); each request attends to its slots only, read by cp.async.
    precision : "fast" (q and p in e4m3: ~2.8e-2 relative error) or "accurate" (each as two e4m3
        terms, twice the MMAs: ~2e-3, the error of a 16-bit query).
    num_stages, ctas_per_sm, max_len : tuning (``GPU_CONFIG``): ring depth
        (num_stages x 36 KB of shared memory), the CTAs per SM the default split count aims at
        (one wave), the longest kv_lens (spares a device -> host read).
    pipeline : the pipelined tile loop: a tile's score MMA and the previous tile's p @ V issued before
        its softmax, so that they run under it (two p buffers; num_stages >= 2); None: the config's
        default where the loop is built (``use_pipeline``: on at 17-32 heads, dense, fast).
    block_h : heads a CTA (16 or 32; 64 on two warpgroups); None: ``block_config``.
    num_warps : 4 or 8 puts a 16- or 32-head block on one or two warpgroups (``GPU_CONFIG_TWO_WG``);
        None: ``default_warps`` (4 for 16-head blocks but sparse accurate ones on per-tensor rows, else 8).
    part_dtype : dtype of the split partials (torch.float32 or torch.bfloat16); None: ``PART_DTYPE``.
    slot_ring : sparse, per-tensor rows: the slots by cp.async into a shared-memory ring a ring's
        length ahead of their rows (``use_slot_ring``; None: with two warpgroups, or fast).
    max_split_len : at most this many tokens per split (more splits when the default has longer ones);
        None: ``ACCURATE_SPLIT_LEN`` when accurate, no cap when fast; 0: no cap. The FP8 MMA's accumulator keeps
        few bits below the running sum's exponent, so p @ V loses more as a split grows
        (``labkit.mma_model``): past 4096 tokens a split breaks the 3e-3 rule (H200, 128 heads 8K).

    Returns
    -------
    out : [B, H, 512] q dtype; with ``return_lse`` also lse : [B, H] float32 (natural log).
    """
    sparse = token_indices is not None
    ds = check_ds_args(kv_buffer, kv_layout, sparse, k_scale, v_scale)
    kv, kv32, kv16 = rows_views(kv_buffer, kv_layout)  # e4m3, fp32 and bf16 views of the same rows
    row = LAYOUT_ROW[kv_layout]
    B, H, page_size = check_decode_args("mla_decode_fp8_gluon", q_nope, q_pe, kv[..., :576], kv_indptr, kv_indices,
                                        kv_lens, kv_dtypes=(torch.float8_e4m3fn,), row=row)
    dev = q_nope.device
    check_gluon_args(H, page_size, dev, sparse)
    if precision not in PRECISIONS:
        raise ValueError(f"mla_decode_fp8_gluon: precision={precision!r}; allowed {list(PRECISIONS)}")
    if sparse and (token_indices.dtype != torch.int32 or token_indices.dim() != 2 or token_indices.shape[0] != B
                   or not token_indices.is_contiguous()):
        raise ValueError(f"mla_decode_fp8_gluon: token_indices must be contiguous int32 [B={B}, topk], got "
                         f"{token_indices.dtype} {tuple(token_indices.shape)}")
    if kv_buffer.stride(0) != page_size * row:
        raise ValueError(f"mla_decode_fp8_gluon: kv_buffer pages must be dense (stride(0) = page_size * {row}), "
                         f"got strides {tuple(kv_buffer.stride())}")
    block_h, num_warps, cfg = block_config(H, block_h, num_warps, precision, sparse, ds)
    cfg = split_rule(cfg, precision) if part_dtype is None else dict(cfg)
    cfg.update({k: v for k, v in dict(num_stages=num_stages, ctas_per_sm=ctas_per_sm).items() if v is not None})
    if cfg["num_stages"] not in (1, 2, 3, 4, 5):
        raise ValueError(f"mla_decode_fp8_gluon: num_stages={cfg['num_stages']}; allowed 1..5 (36 KB each)")
    pipe = use_pipeline(cfg, block_h, sparse, ds, precision, pipeline)
    ring = use_slot_ring(sparse, ds, num_warps, slot_ring, precision)
    if v_scale is None:
        v_scale = k_scale
    head_blocks = triton.cdiv(H, block_h)
    topk = token_indices.shape[1] if sparse else 0
    if not sparse and max_len is None:
        max_len = int(kv_lens.max()) if B else 0
    num_splits = resolve_splits("mla_decode_fp8_gluon", num_splits, B, head_blocks, kv_lens,
                                topk if sparse else max_len, BLOCK_N, dev, cfg["ctas_per_sm"], cfg["min_tiles"],
                                cfg["max_splits"])
    num_splits = capped_splits(num_splits, topk if sparse else max_len, precision, max_split_len)
    direct, o_buf, lse_buf = decode_buffers(B, H, num_splits, q_nope.dtype, dev, part_dtype_for(precision, part_dtype))
    if B == 0:
        return (o_buf, lse_buf) if return_lse else o_buf
    triton.set_allocator(_scratch)  # the kernel's TMA descriptors live in Triton-allocated scratch
    _mla_decode_fp8_gluon_kernel[(head_blocks, B, num_splits)](
        q_nope, q_pe, kv, kv16, kv32, kv_buffer.shape[0] * page_size, kv_indptr, kv_indices, kv_lens,
        token_indices if sparse else kv_lens, topk, o_buf, lse_buf,
        float(sm_scale) * float(k_scale) * LOG2E, float(v_scale), H, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), o_buf.stride(0), o_buf.stride(1),
        PAGE=page_size, BLOCK_H=block_h, DIRECT=direct, NUM_STAGES=cfg["num_stages"], NUM_WARPS=num_warps,
        SPARSE=sparse, SPLIT=precision == "accurate", DS=ds, PIPE=pipe, SLOT_RING=ring,
        num_warps=num_warps,
    )
    out, lse = (o_buf, lse_buf) if direct else mla_merge(o_buf, lse_buf, q_nope.dtype, float(v_scale))
    return (out, lse) if return_lse else out
