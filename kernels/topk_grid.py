"""Top-k token selection for the DSA indexer by radix select over a grid of programs: one launch a
round, no program waiting for another. Triton.

Same contract as ``topk_select`` (slots int32 [B, topk]: global token ids of each request's topk
largest logits among its first kv_lens[b] positions, in no set order; a request with kv_lens[b] <=
topk gets all its tokens in context order, then -1; NaN counts as -inf), but a different shape of
work. ``topk_select`` gives a request one to a few programs that meet at barriers, so at 64
requests x 32K each of its 128 programs owns an SM and runs its passes at low occupancy (29% of
issue cycles on the H200, run 12b). Here every launch is a full grid of (request, tile) programs:

1-4. Four rounds fix the k-th largest key, 8 bits a round (``_topk_grid_round_kernel``): each
   program counts the digits of its tile's keys that share the bits fixed so far (re-derived in
   its prologue from the request's earlier histograms) and adds them to the request's histogram
   in global memory: ``tl.histogram`` then one atomic a non-zero bin, or, where the tile holds at
   most ``FEW`` such keys (the later rounds, mostly), one atomic a key. 8-bit digits: the cost of
   ``tl.histogram`` grows with its bins (a popc per bin a lane owns), and 11-bit ones compiled to
   about 8000 instructions a 4096-key tile.
5. ``_topk_grid_count_kernel``: each program counts its keys above the k-th key K and equal to it;
   program 0 of a request stores K and how many of the equal keys to take.
6. ``_topk_grid_write_kernel``: each program adds up the counts of the request's earlier tiles and
   writes its slots at those offsets (keys above K first, then the first equal ones in context
   order: the output does not depend on timing), and zeroes the histograms for the next call, so
   that a captured graph needs no memset.

Measured (run 22a, H100, CUDA-graph us, against ``topk_select`` in the same call): 64 x 32K 64.5
against 47.2, 1 x 32K 32.7 against 14.8, 64 x 128K 221.5 against 156.8, 128 x 32K 115.7 against
79.1; tiles of 1024-8192 logits and 8 warps no better. About 5 us a launch at one request (8
programs) and 11 at 64 x 32K: each round's programs are latency-bound chains of ~3000 instructions
a warp, about half the issue rate the prediction assumed. Not a default.

Bytes per request of n > topk positions: 4 n read six times (from L2 at GLM-5's sizes: the logits
kernel has just written them), 4 B a slot written and 4 B of page table read a slot, 8 B of counts
a tile; 4 KB of histograms a request, in the device's zeroed scratch that the kernels leave at zero
(``topk_select._barriers``, which its barrier counts and ``index_sample``'s arrival counts share).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_select import _barriers, _check_args, _digit, _slot, _ukey

NB = 256  # histogram bins a round (8-bit digits, four rounds)
HIST = 4 * NB  # int32 histogram counts a request
FEW = 64  # a tile with at most this many keys to count adds them one atomic each


@triton.jit
def _fixed(h, topk, ROUNDS: tl.constexpr):
    """The digits fixed by the first ``ROUNDS`` rounds (from the request's histograms at h) as the
    key's top 8 * ROUNDS bits, and the rank of the k-th key left among the keys that share them."""
    r = topk
    pre = 0
    for i in tl.static_range(ROUNDS):
        d, r, _c = _digit(tl.load(h + i * 256 + tl.arange(0, 256)), r, 256)
        pre = (pre << 8) | d
    return pre, r


@triton.jit
def _topk_grid_round_kernel(logits, stride_l, lens, hist, topk, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                            FEW: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(lens + b)
    if (n > topk) & (t * BLOCK < n):
        h = hist + b * 1024
        pre, _r = _fixed(h, topk, ROUND)
        pos = t * BLOCK + tl.arange(0, BLOCK)
        m = pos < n
        k = _ukey(logits + b.to(tl.int64) * stride_l + pos, m)
        digit = (k >> (24 - 8 * ROUND)) & 255
        ok = m
        if ROUND > 0:  # only the keys that share the bits fixed so far
            ok = m & (((k >> (32 - 8 * ROUND)) & ((1 << (8 * ROUND)) - 1)) == pre)
        dst = h + ROUND * 256
        if tl.sum(ok.to(tl.int32), 0) <= FEW:  # few keys to count (the later rounds, mostly): one atomic each
            tl.atomic_add(dst + digit, 1, mask=ok, sem="relaxed")
        else:
            counts = tl.histogram(digit, 256, mask=ok)
            tl.atomic_add(dst + tl.arange(0, 256), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _above_and_tied(row, pos, n, K):
    """Masks of the positions ``pos`` (< n) of ``row`` whose keys are above the key K, and equal to it."""
    m = pos < n
    k = _ukey(row + pos, m)
    flip = -2147483648  # xor with the sign bit: signed order of the flipped keys = unsigned order
    return m & ((k ^ flip) > (K ^ flip)), m & (k == K)


@triton.jit
def _topk_grid_count_kernel(logits, stride_l, lens, hist, kq, counts, topk, P, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(lens + b)
    if (n > topk) & (t * BLOCK < n):
        K, take = _fixed(hist + b * 1024, topk, 4)
        gt, eq = _above_and_tied(logits + b.to(tl.int64) * stride_l, t * BLOCK + tl.arange(0, BLOCK), n, K)
        c = counts + (b * P + t) * 2
        tl.store(c, tl.sum(gt.to(tl.int32), 0))
        tl.store(c + 1, tl.sum(eq.to(tl.int32), 0))
        if t == 0:
            tl.store(kq + b * 2, K)
            tl.store(kq + b * 2 + 1, take)


@triton.jit
def _topk_grid_write_kernel(logits, stride_l, lens, indptr, indices, hist, kq, counts, out, topk, P,
                            BLOCK: tl.constexpr, PP: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(lens + b)
    pages = indices + tl.load(indptr + b)
    pos = t * BLOCK + tl.arange(0, BLOCK)
    o = out + b.to(tl.int64) * topk
    if n <= topk:  # the whole context in order, then -1
        m = pos < topk
        tl.store(o + pos, tl.where(pos < n, _slot(pages, pos, m & (pos < n), PAGE), -1), mask=m)
    elif t * BLOCK < n:
        K = tl.load(kq + b * 2)
        take = tl.load(kq + b * 2 + 1)
        q = tl.arange(0, PP)
        prior = q < t
        c = counts + (b * P + q) * 2
        base_gt = tl.sum(tl.load(c, mask=prior, other=0), 0)
        base_eq = tl.sum(tl.load(c + 1, mask=prior, other=0), 0)
        gt, eq = _above_and_tied(logits + b.to(tl.int64) * stride_l, pos, n, K)
        i_gt = base_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        i_eq = base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        eq = eq & (i_eq < take)
        slot = _slot(pages, pos, gt | eq, PAGE)
        tl.store(o + i_gt, slot, mask=gt)
        tl.store(o + (topk - take) + i_eq, slot, mask=eq)
    if t == 0:  # every read of this request's histograms was in the count launch: zero them for the next call
        tl.store(hist + b * 1024 + tl.arange(0, 1024), tl.zeros([1024], tl.int32))


def topk_grid(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, *, block: int = 4096,
              num_warps: int = 4) -> torch.Tensor:
    """Global token slots of each request's ``topk`` largest logits, by six launches over a grid of
    (tile, request) programs.

    Parameters
    ----------
    logits : [B, max_len] torch.float32, rows contiguous (any row stride); positions >= kv_lens[b]
        are never read.
    kv_lens : [B] int32 context lengths (0 allowed); kv_indptr : [B + 1] int32; kv_indices : [nnz]
        int32 KV page ids.
    page_size : KV page size (>= 1); topk : slots per request (>= 1).
    block : logits a program (a power of two 16..32768); num_warps.

    Returns
    -------
    slots : [B, topk] torch.int32, as ``topk_select``'s; keys tied at the k-th are taken in context
    order. Scratch: 8 B a tile and 8 B a request; HIST int32 a request of ``_barriers``.
    """
    B, T = _check_args(logits, kv_lens, kv_indptr, kv_indices, page_size, topk, block)
    out = torch.empty(B, topk, dtype=torch.int32, device=logits.device)
    if B == 0:
        return out
    P = max(1, -(-T // block))  # tiles over the longest row
    hist = _barriers(logits.device, B * HIST)  # zero between calls: the write launch zeroes its part
    kq = torch.empty(B, 2, dtype=torch.int32, device=logits.device)
    counts = torch.empty(B, P, 2, dtype=torch.int32, device=logits.device)
    for r in range(4):
        _topk_grid_round_kernel[(P, B)](logits, logits.stride(0), kv_lens, hist, topk, ROUND=r, BLOCK=block, FEW=FEW,
                                        num_warps=num_warps)
    _topk_grid_count_kernel[(P, B)](logits, logits.stride(0), kv_lens, hist, kq, counts, topk, P, BLOCK=block,
                                    num_warps=num_warps)
    _topk_grid_write_kernel[(max(P, -(-topk // block)), B)](
        logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, hist, kq, counts, out, topk, P, BLOCK=block,
        PP=triton.next_power_of_2(P), PAGE=page_size, num_warps=num_warps)
    return out
