"""Candidates for the DSA indexer's top-k by a sampled threshold: one pass over each request's logits
keeps the few that can be in its top-k, so that the exact radix select (``topk_select``) runs over
those instead of the whole row. Triton.

Per request of n > topk positions: S = min(n, SAMPLE) evenly spaced logits (position j * n // S)
are keyed as ``topk_select`` keys them (``_key``: unsigned order = float order, NaN = -inf), and
two 8-bit histogram rounds find the top 16 bits t16 of the key ranked rs among them, where
rs = ceil(topk * S / n) * 5 / 4 + 8 is the k-th's expected sample rank with a margin. One pass
then writes every logit whose key's top 16 bits are >= t16 (position order, as stored) and its
global token slot to the request's row of ``crow`` / ``cslot``, and the count to ``count[b]``.
Every key left out is below every key kept, so when the count reaches topk the top-k is among the
candidates, exactly. When it does not (the sample missed the row's structure, e.g. large logits
only between the sampled positions), a second pass keeps every position. A request of
n <= topk, or whose rs would pass the sample's end, keeps every position in order. The margin
makes a short count rare on rows without structure: at 32K and topk 2048 with S = 2048, rs = 168
where 128 are expected, 3.6 standard deviations of the sample's count.

Moves per request 4 S B of sampled logits (scattered reads) and 4 n B of logits (from L2 when the
logits kernel has just written them), and writes 8 B per candidate (about 1.3 topk, at most n).
The count never exceeds n, so the scratch rows are as long as the logits' rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_select import _digit, _key, _slot


@triton.jit
def _sample_prefix(row, n, S, rs, SAMPLE: tl.constexpr, CG: tl.constexpr = False):
    """Top 16 bits (0..65535) of the rs-th largest key among row[j * n // S], j < S (1 <= rs <= S).
    CG: read from L2 (stored by other programs)."""
    j = tl.arange(0, SAMPLE)
    ok = j < S
    if CG:
        x = tl.load(row + j.to(tl.int64) * n // S, mask=ok, other=float("-inf"), cache_modifier=".cg")
    else:
        x = tl.load(row + j.to(tl.int64) * n // S, mask=ok, other=float("-inf"))
    uk = _key(x)
    hi = (uk >> 24) & 255
    d1, r1, _ = _digit(tl.histogram(hi, 256, mask=ok), rs, 256)
    d2, _, _ = _digit(tl.histogram((uk >> 16) & 255, 256, mask=ok & (hi == d1)), r1, 256)
    return (d1 << 8) | d2


@triton.jit
def _keep_above(row, n, t16, cr, cs, pages, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """row[0:n]'s logits whose keys' top 16 bits are >= t16, and their slots, to cr / cs in position
    order; returns how many."""
    c = n * 0
    x_next = tl.load(row + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < n, other=float("-inf"))
    for s in range(0, n, BLOCK):
        i = s + tl.arange(0, BLOCK)
        x = x_next
        x_next = tl.load(row + i + BLOCK, mask=i + BLOCK < n, other=float("-inf"))  # under this tile's work
        keep = (i < n) & (((_key(x) >> 16) & 0xFFFF) >= t16)
        dst = c + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(cr + dst, x, mask=keep)
        tl.store(cs + dst, _slot(pages, i, keep, PAGE), mask=keep)
        c += tl.sum(keep.to(tl.int32), 0)
    return c


@triton.jit
def _topk_prefilter_kernel(logits, stride_l, lens, indptr, indices, crow, cslot, count, starts, stride_c, topk,
                           PAGE: tl.constexpr, SAMPLE: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr):
    """Program b: request b's candidates (module docstring), and where its row of cslot starts.
    FIRST = False: the first pass was the logits kernel's (count[b] candidates written); only the
    check and the fallback are left."""
    b = tl.program_id(0).to(tl.int64)
    tl.store(starts + b, b * stride_c)
    if b == tl.num_programs(0) - 1:
        tl.store(starts + b + 1, (b + 1) * stride_c)
    n = tl.load(lens + b)
    row = logits + b * stride_l
    pages = indices + tl.load(indptr + b)
    cr, cs = crow + b * stride_c, cslot + b * stride_c
    if FIRST:
        t16 = n * 0  # 0: every position
        if n > topk:
            S = tl.minimum(n, SAMPLE)
            rs = _sample_rank(n, S, topk)
            if rs < S:
                t16 = _sample_prefix(row, n, S, rs, SAMPLE)
        c = _keep_above(row, n, t16, cr, cs, pages, PAGE, BLOCK)
    else:
        c = tl.load(count + b)
    if c < tl.minimum(topk, n):  # the threshold sat too high: keep every position
        c = _keep_above(row, n, 0, cr, cs, pages, PAGE, BLOCK)
    tl.store(count + b, c)


@triton.jit
def _sample_rank(n, S, topk):
    """The k-th's expected rank among S of n sampled logits, with the margin (module docstring)."""
    rs = (topk * S + n - 1) // n
    return rs + rs // 4 + 8


@triton.jit
def _sampled_threshold(sampled, n, topk, SAMPLE: tl.constexpr, CG: tl.constexpr = False):
    """t16 of a request of n positions from its S = min(n, SAMPLE) sampled logits sampled[:S]: 65536
    (none kept) when n <= topk, so that the fallback keeps every position in order; 0 (all kept)
    when the sample's rank would pass its end. CG: read from L2 (stored by other programs)."""
    t = n * 0 + 65536
    if n > topk:
        S = tl.minimum(n, SAMPLE)
        rs = _sample_rank(n, S, topk)
        t = n * 0
        if rs < S:
            t = _sample_prefix(sampled, S, S, rs, SAMPLE, CG)
    return t


@triton.jit
def _threshold_kernel(sampled, stride_s, lens, t16, count, topk, SAMPLE: tl.constexpr):
    """Program b: t16[b] from request b's sampled logits sampled[b] (``_sampled_threshold``), and
    count[b] = 0 for the logits kernel's candidates."""
    b = tl.program_id(0).to(tl.int64)
    tl.store(t16 + b, _sampled_threshold(sampled + b * stride_s, tl.load(lens + b), topk, SAMPLE))
    tl.store(count + b, 0)


def topk_prefilter(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, sample: int,
                   block: int = 4096, num_warps: int = 8):
    """Each request's top-k candidates (module docstring).

    logits : [B, T] float32, rows contiguous; kv_lens [B], kv_indptr [B + 1], kv_indices int32: the
        decode batch's page table (``topk_select``'s arguments, checked there).
    sample : logits sampled per request (a power of two, 16..8192); block : logits per tile of
        the pass (a power of two, 16..32768).

    Returns (crow [B, T] float32, cslot [B, T] int32, count [B] int32, starts [B + 1] int32): request
    b's candidates are crow[b, :count[b]] with global token slots cslot[b, :count[b]], in position
    order (past count the rows are unwritten); starts = 0, T, 2T, ... is the page table (page size
    1) through which ``topk_select`` reads cslot as the candidates' slots.
    """
    B, T = logits.shape
    crow = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    cslot = torch.empty(B, T, dtype=torch.int32, device=logits.device)
    count = torch.empty(B, dtype=torch.int32, device=logits.device)
    starts = torch.empty(B + 1, dtype=torch.int32, device=logits.device)  # all written by the kernel when B > 0
    if B:
        _topk_prefilter_kernel[(B,)](logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, crow, cslot, count,
                                     starts, T, topk, PAGE=page_size, SAMPLE=sample,
                                     BLOCK=min(block, triton.next_power_of_2(max(T, 16))), FIRST=True,
                                     num_warps=num_warps)
    return crow, cslot, count, starts


def sample_positions(kv_lens, sample: int, run: int = 1):
    """The positions the threshold samples: kv_lens [B] int -> (positions [B, sample] int64, -1 past S;
    S [B] int32 = min(n, sample)). With run = 1, j * n // S for j < S; with run > 1 (a power of two
    dividing sample) where n > sample, sample / run runs of ``run`` consecutive positions, run r
    starting at (r * n // runs) rounded down to a multiple of ``run`` (in one KV page when the page
    size is a multiple of run: the keys are read as whole rows of a block, not one row here and
    there; the runs' logits are less independent than single positions, which the fallback covers).
    Made once per batch (any layer's logits at these positions, e.g. ``index_logits`` over
    ``labkit.indexer.token_ids`` of them at page size 1)."""
    if run < 1 or run & (run - 1) or sample % run:
        raise ValueError(f"run={run!r}: must be a power of two dividing sample={sample}")
    n = kv_lens.long()[:, None]
    S = n.clamp_max(sample)
    j = torch.arange(sample, device=kv_lens.device)[None, :]
    pos = j * n // S.clamp_min(1)
    if run > 1:
        runs = sample // run
        start = (j // run) * n // runs // run * run
        pos = torch.where(n > sample, start + j % run, pos)
    return torch.where(j < S, pos, -1), S[:, 0].to(torch.int32)


def sample_threshold(sampled, kv_lens, topk: int):
    """Thresholds for ``index_logits(candidates=...)`` from each request's sampled logits.

    sampled : [B, sample] float32, request b's logits at ``sample_positions`` (the first
        min(kv_lens[b], sample) entries are read); kv_lens : [B] int32; topk : >= 1.
    Returns (t16 [B] int32, count [B] int32 zeroed): made by one launch, ready for the logits kernel.
    """
    B, sample = sampled.shape
    if sample < 16 or sample & (sample - 1) or sample > 8192 or sampled.stride(1) != 1:
        raise ValueError(f"sampled must be [B, S] float32 with S a power of two in 16..8192 and contiguous rows, "
                         f"got {tuple(sampled.shape)}")
    t16 = torch.empty(B, dtype=torch.int32, device=sampled.device)
    count = torch.empty(B, dtype=torch.int32, device=sampled.device)
    if B:
        _threshold_kernel[(B,)](sampled, sampled.stride(0), kv_lens, t16, count, topk, SAMPLE=sample, num_warps=4)
    return t16, count


def finish_candidates(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, crow, cslot, count,
                      block: int = 4096, num_warps: int = 8):
    """After ``index_logits(candidates=(t16, crow, cslot, count))``: the fallback of every request
    whose count fell short of min(topk, kv_lens[b]) (every request of n <= topk, whose t16 kept
    none, so that its slots come in context order), and the page table of the candidates.
    Arguments as ``topk_prefilter``'s; returns its four tensors (crow and cslot in no set order)."""
    B, T = logits.shape
    starts = torch.empty(B + 1, dtype=torch.int32, device=logits.device)
    if B:
        _topk_prefilter_kernel[(B,)](logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, crow, cslot, count,
                                     starts, crow.stride(0), topk, PAGE=page_size, SAMPLE=16,
                                     BLOCK=min(block, triton.next_power_of_2(max(T, 16))), FIRST=False,
                                     num_warps=num_warps)
    return crow, cslot, count, starts
