"""Top-k token selection for the DSA indexer by radix select: per request, the ``topk`` largest
logits among its first kv_lens[b] positions, written as global token slots. One launch. Triton.

Slots as ``labkit.indexer.select_tokens``: int32 [B, topk]; position p of request b is token
kv_indices[kv_indptr[b] + p // page_size] * page_size + p % page_size. A request with
kv_lens[b] <= topk gets all its tokens in context order, then -1; a longer one gets exactly topk
distinct tokens in no set order, ties at the k-th logit broken arbitrarily. NaN counts as -inf.

Method. Each logit becomes a 32-bit key whose unsigned order is the float order (``_ukey``).
Rounds of histograms over the row (``tl.histogram``, 2^DB bins; 16 / DB rounds) fix the top 16
bits of the k-th largest key, DB bits a round, each round counting only the keys that share the
bits fixed so far. A pass then writes the slots of the keys above that 16-bit prefix (fewer than
topk) and copies the keys equal to it (the candidates: same sign, exponent and 7 mantissa bits as
the k-th) with their slots to scratch; two 8-bit rounds on the candidates fix the low 16 bits
and a last pass takes the larger candidates, then as many equal ones as are missing. Three to nine
passes over the row whatever the logits' spread; nothing is sampled or guessed.

Splits. The row passes cost a few instructions per logit (the histogram is a ballot per key bit),
so one program per request leaves a long row on one SM (1 x 32K: 78 us on the H200). With
``splits`` > 1 a request's row is cut into that many parts, one program each, which meet after
every round at a barrier (an arrival count per request, ``_barriers``): each publishes its
histogram, all sum the same histograms and take the same digit; after the last round each knows
every part's counts, so parts write their slots and candidates at fixed offsets (the output order
does not depend on timing). Program 0 waits for the others and finishes the candidates. The
programs of a request spin on each other, so all must be resident at once: B * splits is at most
the SM count (one program an SM always is; two an SM, where the compiled kernel fits them, measured
no faster in run 23, since the row passes are issue-bound), and the interpreter (one program after
another) takes splits = 1.

Prefilter (``sample``). Most of a long row cannot be in its top-k: ``topk_prefilter`` keeps, in one
pass, the logits at or above a threshold sampled from the row (exact: every key left out is below
every key kept, and a row whose sample misses keeps everything), and the rounds then run over
those candidates, one program a request, with no barriers.

Counting (``count``). ``tl.histogram`` costs about 2.7 warp-instructions a key on sm_90 (8 ballots,
then a popc per bin a lane owns; 1388 instructions a 4096-key tile of the first round). "atomic" adds
each key to the part's counters in global memory (a RED a key: 436 a tile); fewer instructions, but
each add is an L2 round trip on the few bins the logits' exponents hit (``default_count``).

Bytes per request of n > topk positions: 4 n read 16 / DB + 1 times (after the first, mostly from
L2: the logits kernel has just written them), 8 B per candidate written and read up to three
times, 4 B per slot written and 4 B of page table read per slot; with splits, 4 << DB B of
histogram per part and round, written once and read by every part.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _key(x):
    """int32 keys of float32 values whose unsigned order (bit 31 highest) is the float order; NaN
    counts as -inf; -0.0 and +0.0 give the same key."""
    x = tl.where(x == x, x, float("-inf"))
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) | -2147483648)  # positive: flip the sign bit; negative: flip every bit


@triton.jit
def _ukey(ptr, mask):
    """``_key`` of the float32 logits at ``ptr``; masked lanes read as -inf."""
    return _key(tl.load(ptr, mask=mask, other=float("-inf")))


@triton.jit
def _digit(hist, r, NB: tl.constexpr):
    """From a histogram of NB bins and a rank r (1 <= r <= its total): the bin d holding the r-th
    largest, the rank left for it inside bin d, and bin d's count."""
    bins = tl.arange(0, NB)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys in this bin or a larger one
    d = tl.max(tl.where(ge >= r, bins, -1), 0)
    return d, r - tl.sum(tl.where(bins > d, hist, 0), 0), tl.sum(tl.where(bins == d, hist, 0), 0)


@triton.jit
def _count(hist, cnt, digit, ok, NB: tl.constexpr, COUNT: tl.constexpr):
    """Add the digits of the ok lanes: into hist (COUNT 0, tl.histogram: a ballot per digit bit and a
    popc per bin a lane owns), or into the int32 counters at cnt, one atomic a key (COUNT 1)."""
    if COUNT == 0:
        hist += tl.histogram(digit, NB, mask=ok)
    else:
        tl.atomic_add(cnt + digit, 1, mask=ok, sem="relaxed")
    return hist


@triton.jit
def _row_hist(row, p0, p1, prefix, cnt, SHIFT: tl.constexpr, DB: tl.constexpr, BLOCK: tl.constexpr,
              COUNT: tl.constexpr):
    """Histogram of the DB-bit digit at SHIFT of row[p0:p1]'s keys whose bits above it equal prefix's.
    COUNT 1 (``_count``): counted into this part's zeroed counters at cnt, then read back."""
    hist = tl.zeros([1 << DB], tl.int32)
    i = p0 + tl.arange(0, BLOCK)
    uk = _ukey(row + i, i < p1)
    for s in range(p0, p1, BLOCK):
        ok = s + tl.arange(0, BLOCK) < p1
        nxt = s + BLOCK + tl.arange(0, BLOCK)
        uk_next = _ukey(row + nxt, nxt < p1)  # the next tile loads while this one is counted
        if SHIFT + DB < 32:
            ok = ok & (((uk ^ prefix) >> (SHIFT + DB)) == 0)
        hist = _count(hist, cnt, (uk >> SHIFT) & ((1 << DB) - 1), ok, 1 << DB, COUNT)
        uk = uk_next
    if COUNT > 0:
        tl.debug_barrier()  # every thread's atomics are done (performed in L2): read the counters back
        hist = tl.load(cnt + tl.arange(0, 1 << DB), cache_modifier=".cg")
    return hist


@triton.jit
def _arrive(bar):
    """Arrive at a request's barrier (``bar``: its int32 arrival count), after this program's
    stores (the CTA barrier orders the other threads' stores before thread 0's release)."""
    tl.debug_barrier()
    tl.atomic_add(bar, 1, sem="release", scope="gpu")  # a scalar atomic: one thread


@triton.jit
def _wait(bar, target):
    """Spin until the barrier's count reaches ``target``; then every thread may read what the
    arrived programs stored."""
    cnt = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    while cnt < target:
        cnt = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _slot(pages, pos, mask, PAGE: tl.constexpr):
    """Global token ids (int32) of context positions ``pos`` through the request's page list."""
    page = tl.load(pages + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return (page * PAGE + pos % PAGE).to(tl.int32)


@triton.jit
def _compact(row, p0, p1, key16, n_top, n_cand, o, pages, ckey, cslot, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """row[p0:p1]: slots of the keys whose top 16 bits exceed key16 to o[n_top...], keys equal in
    those bits (the candidates) and their slots to ckey/cslot[n_cand...], in position order (the
    page table is read here, where its loads overlap the row's, not on program 0's last stretch)."""
    uk_next = _ukey(row + p0 + tl.arange(0, BLOCK), p0 + tl.arange(0, BLOCK) < p1)
    for s in range(p0, p1, BLOCK):
        i = s + tl.arange(0, BLOCK)
        ok = i < p1
        uk = uk_next
        uk_next = _ukey(row + i + BLOCK, i + BLOCK < p1)  # the next tile loads while this one is written
        hi16 = (uk >> 16) & 0xFFFF
        top = ok & (hi16 > key16)
        cand = ok & (hi16 == key16)
        both = top.to(tl.int32) + (cand.to(tl.int32) << 16)  # one scan for both (BLOCK < 2^16)
        inc = tl.cumsum(both, 0)
        slot = _slot(pages, i, top | cand, PAGE)
        tl.store(o + n_top + (inc & 0xFFFF) - 1, slot, mask=top)
        c_off = n_cand + (inc >> 16) - 1
        tl.store(ckey + c_off, uk, mask=cand)
        tl.store(cslot + c_off, slot, mask=cand)
        tot = tl.sum(both, 0)
        n_top += tot & 0xFFFF
        n_cand += tot >> 16


@triton.jit
def _cand_hist(ckey, m, d3, SHIFT: tl.constexpr, CB: tl.constexpr):
    """Histogram of the byte at SHIFT (8 or 0) of the m candidate keys; at 0, of those whose byte 8 is d3."""
    hist = tl.zeros([256], tl.int32)
    for s in range(0, m, CB):
        i = s + tl.arange(0, CB)
        ok = i < m
        uk = tl.load(ckey + i, mask=ok, other=0, cache_modifier=".cg")
        if SHIFT == 0:
            ok = ok & (((uk >> 8) & 255) == d3)
        hist += tl.histogram((uk >> SHIFT) & 255, 256, mask=ok)
    return hist


@triton.jit
def _take(ckey, cslot, m, r, o, CB: tl.constexpr):
    """Slots of the r largest of the m candidates (1 <= r <= m; equal top 16 bits) to o[0:r].
    Candidates come from other programs too: read from L2 (.cg), never from a stale L1 line."""
    kth = m * 0 - 1  # low 16 bits of the k-th key; -1: every candidate is taken (r == m)
    r_eq = m * 0
    if r < m:
        if m <= CB:  # the usual case: one tile, both rounds on the same registers
            i = tl.arange(0, CB)
            ok = i < m
            uk = tl.load(ckey + i, mask=ok, other=0, cache_modifier=".cg")
            d3, r3, _ = _digit(tl.histogram((uk >> 8) & 255, 256, mask=ok), r, 256)
            d4, r_eq, _ = _digit(tl.histogram(uk & 255, 256, mask=ok & (((uk >> 8) & 255) == d3)), r3, 256)
        else:
            d3, r3, _ = _digit(_cand_hist(ckey, m, 0, 8, CB), r, 256)
            d4, r_eq, _ = _digit(_cand_hist(ckey, m, d3, 0, CB), r3, 256)
        kth = (d3 << 8) | d4
    n_gt = m * 0
    n_eq = m * 0
    for s in range(0, m, CB):
        i = s + tl.arange(0, CB)
        ok = i < m
        lo16 = tl.load(ckey + i, mask=ok, other=0, cache_modifier=".cg") & 0xFFFF
        gt = ok & (lo16 > kth)
        eq = ok & (lo16 == kth)
        both = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        inc = tl.cumsum(both, 0)
        rank_eq = n_eq + (inc >> 16) - 1
        take = gt | (eq & (rank_eq < r_eq))
        dst = tl.where(gt, n_gt + (inc & 0xFFFF) - 1, r - r_eq + rank_eq)  # ties after the larger
        tl.store(o + dst, tl.load(cslot + i, mask=take, other=0, cache_modifier=".cg"), mask=take)
        tot = tl.sum(both, 0)
        n_gt += tot & 0xFFFF
        n_eq += tot >> 16


@triton.jit
def _select_in_registers(row, n, topk, o, pages, PAGE: tl.constexpr, REGS: tl.constexpr):
    """The top-k of a row of topk < n <= REGS keys loaded once: four 8-bit rounds on the registers
    fix the k-th key (the keys above it are marked as the rounds go), then one scan writes the slots
    of those above and of the first ties, in position order."""
    i = tl.arange(0, REGS)
    ok = i < n
    uk = _ukey(row + i, ok)
    match = ok  # keys that share the bits fixed so far
    above = i < 0
    r = topk + n * 0
    for rnd in tl.static_range(4):
        d = (uk >> (24 - 8 * rnd)) & 255
        dig, r, _ = _digit(tl.histogram(d, 256, mask=match), r, 256)
        above = above | (match & (d > dig))
        match = match & (d == dig)
    take = above | (match & (tl.cumsum(match.to(tl.int32), 0) <= r))
    tl.store(o + tl.cumsum(take.to(tl.int32), 0) - 1, _slot(pages, i, take, PAGE), mask=take)


@triton.jit
def _topk_radix_kernel(logits, stride_l, lens, indptr, indices, out, ckey, cslot, stride_c, hist, bar, topk, chunk,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr, DB: tl.constexpr,
                       SPLITS: tl.constexpr, SP: tl.constexpr, COUNT: tl.constexpr, REGS: tl.constexpr):
    """Program (b, p): positions [p * chunk, (p + 1) * chunk) of request b. With SPLITS > 1 the
    programs of a request meet at a barrier after each round (every program sums the round's
    histograms, hist [B, rounds, SPLITS, 2^DB] int32, so all take the same digit) and after the
    compaction, where program 0 waits and finishes the request. COUNT > 0: the row rounds count by
    atomics (``_count``) into this part's slices of hist, zeroed here first. REGS > 0 (SPLITS 1): a
    row of at most REGS keys is selected in registers (``_select_in_registers``); 0: never (the
    branch is not compiled)."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = tl.load(lens + b)
    o = out + b * topk
    pages = indices + tl.load(indptr + b)
    NB: tl.constexpr = 1 << DB
    ROUNDS: tl.constexpr = 16 // DB
    if REGS > 0:  # compiled only when asked for
        if (n > topk) & (n <= REGS):
            _select_in_registers(logits + b * stride_l, n, topk, o, pages, PAGE, REGS)
    if n <= topk:
        if p == 0:
            for s in range(0, topk, BLOCK):
                j = s + tl.arange(0, BLOCK)
                tl.store(o + j, tl.where(j < n, _slot(pages, j, j < n, PAGE), -1), mask=j < topk)
    elif (p * chunk < n) & (n > REGS):
        row = logits + b * stride_l
        n_prog = tl.cdiv(n, chunk)  # programs with a part of this row; the others have left
        p0 = p * chunk
        p1 = tl.minimum(n, p0 + chunk)
        bins = tl.arange(0, NB)
        q = tl.arange(0, SP)
        prefix = n * 0  # the top bits of the k-th key found so far
        r = topk + n * 0  # its rank among the keys that share them
        tops = tl.zeros([SP], tl.int32)  # per program: its keys above the prefix so far
        if COUNT > 0:  # this part's counters of every round start at zero
            for zr in tl.static_range(ROUNDS):
                tl.store(hist + ((b * ROUNDS + zr) * SPLITS + p) * NB + bins, tl.zeros([NB], tl.int32))
            tl.debug_barrier()
        for rnd in tl.static_range(ROUNDS):
            hb = hist + ((b * ROUNDS + rnd) * SPLITS) * NB
            h = _row_hist(row, p0, p1, prefix, hb + p * NB, 32 - DB * (rnd + 1), DB, BLOCK, COUNT)
            if SPLITS > 1:
                if COUNT == 0:  # else the atomics have put them there
                    tl.store(hb + p * NB + bins, h)
                _arrive(bar + b)
                _wait(bar + b, (rnd + 1) * n_prog)
                hq = tl.load(hb + q[:, None] * NB + bins[None, :], mask=q[:, None] < n_prog, other=0,
                             cache_modifier=".cg")
            else:
                hq = h[None, :]
            d, r, m = _digit(tl.sum(hq, 0), r, NB)
            tops += tl.sum(tl.where(bins[None, :] > d, hq, 0), 1)
            prefix = prefix | (d << (32 - DB * (rnd + 1)))
        cands = tl.sum(tl.where(bins[None, :] == d, hq, 0), 1)
        ck, cp = ckey + b * stride_c, cslot + b * stride_c
        _compact(row, p0, p1, (prefix >> 16) & 0xFFFF, tl.sum(tl.where(q < p, tops, 0), 0),
                 tl.sum(tl.where(q < p, cands, 0), 0), o, pages, ck, cp, PAGE, BLOCK)
        if SPLITS > 1:
            _arrive(bar + b)
            if p == 0:
                _wait(bar + b, (ROUNDS + 1) * n_prog)
                _take(ck, cp, m, r, o + topk - r, CB)
                tl.atomic_xchg(bar + b, 0)  # every program has arrived for the last time: reset for the next call
        else:
            tl.debug_barrier()  # the candidates were written by other threads of this program
            _take(ck, cp, m, r, o + topk - r, CB)


def _check(name, t, dtype, dims):
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {dtype}")


def check_args(logits, kv_lens, kv_indptr, kv_indices, page_size, topk) -> tuple[int, int]:
    """The checks every top-k kernel shares (this one and ``topk_cuda``): dtypes, shapes, the
    logits' row layout, positive integers; (B, max_len)."""
    _check("logits", logits, torch.float32, 2)
    for name, t in (("kv_lens", kv_lens), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        _check(name, t, torch.int32, 1)
    B, T = logits.shape
    if kv_lens.numel() != B:
        raise ValueError(f"kv_lens has {kv_lens.numel()} entries; logits has B = {B} rows")
    if kv_indptr.numel() != B + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries; expected B + 1 = {B + 1}")
    if T > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    for name, v in (("topk", topk), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    return B, T


def _pow2(name, v, low):
    if isinstance(v, bool) or not isinstance(v, int) or v < low or v & (v - 1) or v >= 1 << 16:
        raise ValueError(f"{name}={v!r}: must be a power of two in {low}..32768")


_BARRIERS: dict = {}  # device -> int32 barrier counts, zero between calls (the kernel resets them)
COUNTS = {"histogram": 0, "atomic": 1}  # topk_select(count=): how the row rounds count


def _barriers(device, n: int) -> torch.Tensor:
    """At least n zeroed int32 barrier counts on ``device``, made once and kept: the kernel leaves them
    at zero, so a captured graph needs no memset (2.6 us a replay on the H200). Shared with
    ``index_sample`` (its arrival counts, also left at zero): calls on one device must not overlap
    in time (one stream), or they would share them."""
    t = _BARRIERS.get(device)
    if t is None or t.shape[0] < n:
        t = _BARRIERS[device] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return t


def default_count(batch_size: int) -> str:
    """How the row rounds count by default: "atomic" for one request (its row over up to 64
    programs: 12.8 / 14.3 / 18.8 us at 8K / 32K / 128K against 13.8 / 15.3 / 18.9 by histogram, H200
    run 12a), "histogram" for more (64 x 32K: 47.8 us against 73.5 atomic: each key's atomic is an L2
    round trip on the few counters the logits' exponents hit)."""
    return "atomic" if batch_size == 1 else "histogram"


def auto_splits(batch_size: int, max_len: int, device) -> int:
    """Programs per request: as many as fit beside the batch's other requests on the GPU's SMs
    (they wait for each other, so all must be resident at once), parts of >= 1024 positions, at
    most 64; 1 on a CPU (Triton's interpreter runs programs one after another)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms // max(batch_size, 1), -(-max_len // 1024), 64))


def topk_select(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, *, splits: int | None = None,
               block: int = 4096, cand_block: int = 256, digit_bits: int = 8, num_warps: int = 8,
               count: str | None = None, sample: int = 0, regs: int = 0) -> torch.Tensor:
    """Global token slots of each request's ``topk`` largest logits.

    Parameters
    ----------
    logits : [B, max_len] torch.float32, rows contiguous (any row stride); positions >= kv_lens[b]
        are never read, so max_len >= max(kv_lens) is all they need (not checked on the device).
    kv_lens : [B] int32, context lengths (0 allowed); kv_indptr : [B + 1] int32; kv_indices : [nnz]
        int32 KV page ids (the decode batch's page table).
    page_size : KV page size (>= 1); topk : slots per request (>= 1).
    splits : programs per request (None: ``auto_splits``; > 1 only on a GPU, with B * splits at
        most the SM count); block : logits per tile of the row passes;
        cand_block : candidates per tile (powers of two 16..32768); digit_bits : bits per radix
        round over the row (2, 4, 8); num_warps.
    count : how the row rounds count digits (``COUNTS``): "histogram" (``tl.histogram``) or "atomic"
        (one atomic add a key into the part's counters); None: ``default_count``.
    sample : 0, or a power of two 16..8192: first keep each request's candidates by a threshold
        sampled from that many of its logits (``labkit.kernels.topk_prefilter``: one pass, exact),
        then select among them, one program a request (``splits`` None or 1, ``count`` None or
        "histogram"). A second launch and 8 * B * max_len bytes more scratch.
    regs : 0, or a power of two 16..8192 (with splits 1): a row of at most that many keys is loaded
        once and selected in registers (four rounds, one scan) instead of by passes over memory.

    Returns
    -------
    slots : [B, topk] torch.int32 global token ids; see the module docstring for order and -1.
    Scratch: 8 * B * max_len bytes (candidate keys and slots); with splits > 1, B * splits *
    16 / digit_bits histograms of 2^digit_bits int32 and the device's barrier counts (``_barriers``).
    """
    B, T = check_args(logits, kv_lens, kv_indptr, kv_indices, page_size, topk)
    _pow2("block", block, 16)
    _pow2("cand_block", cand_block, 16)
    if digit_bits not in (2, 4, 8):
        raise ValueError(f"digit_bits={digit_bits!r}: must be 2, 4 or 8")
    if sample:
        if isinstance(sample, bool) or not isinstance(sample, int) or not 16 <= sample <= 8192 or sample & (sample - 1):
            raise ValueError(f"sample={sample!r}: must be 0 or a power of two in 16..8192")
        if splits not in (None, 1) or count not in (None, "histogram"):
            raise ValueError(f"sample={sample} selects among the candidates in one program a request by histogram; "
                             f"got splits={splits!r}, count={count!r} (allowed: None or 1, None or 'histogram')")
        from .topk_prefilter import topk_prefilter

        crow, cslot, cnt, starts = topk_prefilter(logits, kv_lens, kv_indptr, kv_indices, page_size, topk, sample,
                                                  block=block, num_warps=num_warps)
        return topk_select(crow, cnt, starts, cslot.view(-1), 1, topk, splits=1,
                           block=block, cand_block=cand_block, digit_bits=digit_bits, num_warps=num_warps,
                           count="histogram", regs=regs)
    if regs and (isinstance(regs, bool) or not isinstance(regs, int) or not 16 <= regs <= 8192 or regs & (regs - 1)):
        raise ValueError(f"regs={regs!r}: must be 0 or a power of two in 16..8192")
    if regs and splits not in (None, 1):
        raise ValueError(f"regs={regs} selects a short row in one program; got splits={splits!r} (allowed: None or 1)")
    if regs:
        splits = 1
    if count is None:
        count = default_count(B)
    if count not in COUNTS:
        raise ValueError(f"count={count!r}; allowed: {list(COUNTS)}")
    splits = auto_splits(B, T, logits.device) if splits is None else splits
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 64:
        raise ValueError(f"splits={splits!r}: must be an integer in 1..64, or None")
    if splits > 1 and logits.device.type != "cuda":
        raise ValueError(f"splits={splits}: more than 1 needs a GPU (a request's programs wait for each other)")
    if splits > 1 and B * splits > torch.cuda.get_device_properties(logits.device).multi_processor_count:
        raise ValueError(f"splits={splits}: B * splits = {B * splits} programs exceed the GPU's SMs; "
                         "they wait for each other, so all must be resident")
    out = torch.empty(B, topk, dtype=torch.int32, device=logits.device)
    if B == 0:
        return out
    cap = T if T > topk else 1  # candidates per request: at most its context
    dev = logits.device
    ckey = torch.empty(B, cap, dtype=torch.int32, device=dev)
    cslot = torch.empty(B, cap, dtype=torch.int32, device=dev)
    part = -(-T // splits)
    tile = min(block, triton.next_power_of_2(max(part, 16)))
    chunk = -(-part // tile) * tile
    bar = _barriers(dev, B) if splits > 1 else ckey
    code = COUNTS[count]
    hist = torch.empty(B * (16 // digit_bits) * splits << digit_bits if splits > 1 or code else 1, dtype=torch.int32,
                       device=dev)
    _topk_radix_kernel[(B, splits)](logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, out, ckey, cslot, cap,
                                    hist, bar, topk, chunk, PAGE=page_size, BLOCK=tile, CB=cand_block, DB=digit_bits,
                                    SPLITS=splits, SP=triton.next_power_of_2(splits), COUNT=code, REGS=regs,
                                    num_warps=num_warps)
    return out
