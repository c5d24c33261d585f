"""Top-k token selection for the DSA indexer: per request, the ``topk`` largest logits among its
first kv_lens[b] positions, written as global token slots. Triton.

Slots follow ``labkit.indexer.select_tokens``: int32 [B, topk]; position p of request b is token
kv_indices[kv_indptr[b] + p // page_size] * page_size + p % page_size. A request with
kv_lens[b] <= topk gets all its tokens in context order, then -1; a longer one gets exactly topk
distinct tokens in no set order, ties at the k-th logit broken arbitrarily. NaN counts as -inf.

Method (sample, bracket, then an exact radix select on the few logits left):
1. pivots: a strided sample of ``sample`` logits places NP = 16 ascending pivots around the k-th
   largest: a Gaussian guess (sample mean and deviation), then 3 rounds that count the sample
   against the grid, recentre it on the sample's own quantile and rescale it to the local density
   (the middle gap about 2 sample points wide, gaps growing outwards). It only steers the speed.
2. count: one pass counts the logits >= each pivot; the bracket [lo, hi) is the pair of
   neighbouring pivots with count(>= lo) >= topk > count(>= hi) (lo = -inf, no hi at the ends).
3. compact: one pass writes the positions >= hi to the output (tl.cumsum gives the offsets) and
   the candidates in [lo, hi) (value, position) to a scratch row.
4. select: radix select, 8 bits a round (tl.histogram), on the candidates' order-preserving int32
   keys finds the exact k-th key (rounds within the leading bits that key(lo) and key(hi) - 1
   share are skipped: every candidate has them); a pass writes the candidates above it, then as
   many equal to it as are missing. Last, the row's positions become token slots (page table).
Passes 2-3 cost about 40 and 90 instructions per logit (their loops' SASS for sm_90); only the
candidates (typically 50-500 logits) pay for histograms. ``splits`` > 1 spreads passes 2-3 of a request over that many
programs (three launches: count, compact, select); ``splits`` = 1 is one launch, one program per
request.

Bytes moved per request of n > topk positions: 4 * n read twice (count, compact) plus the sample;
8 B written per candidate and read back up to 5 times; 4 * topk written twice (positions, then slots)
and read once, 4 B of page table per slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_PIVOTS = 16  # pivots of the grid (_grid's gaps reach +-4.5 scale at 16)
REFINE_ROUNDS = 3  # rounds that fit the grid to the sample
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a constexpr: jit code may read it


@triton.jit
def _load_x(ptr, mask):
    """Logits as float32, NaN -> -inf (comparisons with NaN would break the counts)."""
    x = tl.load(ptr, mask=mask, other=float("-inf"))
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _skey(x):
    """int32 whose signed order is the order of the float32 ``x`` (equal floats, -0.0 and +0.0
    included, give equal keys)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _to_slots(out, pages, n, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """out[0:n] in place: context positions -> global token ids (int32) through the page list."""
    for s in range(0, n, BLOCK):
        j = s + tl.arange(0, BLOCK)
        pos = tl.load(out + j, mask=j < n, other=0)
        page = tl.load(pages + pos // PAGE, mask=j < n, other=0).to(tl.int64)
        tl.store(out + j, (page * PAGE + pos % PAGE).to(tl.int32), mask=j < n)


@triton.jit
def _write_short(out, pages, n, topk, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """A context of n <= topk tokens: every token in context order, then -1."""
    for s in range(0, topk, BLOCK):
        j = s + tl.arange(0, BLOCK)
        page = tl.load(pages + j // PAGE, mask=j < n, other=0).to(tl.int64)
        tl.store(out + j, tl.where(j < n, (page * PAGE + j % PAGE).to(tl.int32), -1), mask=j < topk)


@triton.jit
def _pick(v, j, k):
    """v[k] (0 when k is outside) of a column v [NP, 1], j = its row index; exact (one nonzero
    term). A reduction: on sm_90 each costs a layout change or a cross-warp sum (the [NP, 1]
    columns get a layout of their own), which makes the pivot rounds about 350 instructions each."""
    return tl.sum(tl.sum(tl.where(j == k, v, 0), 1), 0)


@triton.jit
def _grid(c, scale, NP: tl.constexpr):
    """Column [NP, 1] of ascending pivots centred on c: gaps of 0.0425 * scale in the middle,
    growing outwards to +-4.5 * scale at NP = 16. Never below -FLT_MAX, so -inf logits (and
    padded lanes) count at no pivot; NaN when c or scale is."""
    u = tl.arange(0, NP)[:, None].to(tl.float32) - (NP - 1) * 0.5
    return tl.maximum(c + 0.04 * u * (1.0 + 0.25 * u * u) * scale, -FLT_MAX)


@triton.jit
def _pivots(row, n, topk, S: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr):
    """Column [NP, 1] of float32 pivots around the k-th largest of row[0:n] (n > topk), from a
    strided sample of S logits (module docstring, step 1)."""
    i = tl.arange(0, S)
    x = _load_x(row + (i.to(tl.int64) * n) // S, i < S)
    fin = (x > float("-inf")) & (x < float("inf"))
    cnt = tl.maximum(tl.sum(fin.to(tl.float32), 0), 1.0)
    mu = tl.sum(tl.where(fin, x, 0.0), 0) / cnt
    d = tl.where(fin, x - mu, 0.0)
    sd = tl.sqrt(tl.sum(d * d, 0) / cnt)
    p = topk.to(tl.float32) / n.to(tl.float32)  # share of the context to keep
    t = tl.sqrt(-2.0 * tl.log(tl.minimum(p, 1.0 - p)))
    # upper-tail normal quantile, Abramowitz & Stegun 26.2.23 (|error| < 4.5e-4)
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    c = mu + tl.where(p <= 0.5, z, -z) * sd
    scale = sd
    target = p * S  # sample points expected at or above the k-th largest
    j = tl.arange(0, NP)[:, None]
    for _ in tl.static_range(ITERS):
        piv = _grid(c, scale, NP)
        cs = tl.sum(tl.where(x[None, :] >= piv, 1.0, 0.0), 1, keep_dims=True)  # [NP, 1]
        jq = tl.max(tl.max(tl.where(cs >= target, j, -1), 1), 0)
        lo, hi = _pick(piv, j, jq), _pick(piv, j, jq + 1)
        c_lo, c_hi = _pick(cs, j, jq), _pick(cs, j, jq + 1)
        inside = (jq >= 0) & (jq < NP - 1)
        gap = tl.maximum(c_lo - c_hi, 1.0)
        c = tl.where(inside, lo + (c_lo - target) / gap * (hi - lo),
                     tl.where(jq < 0, _pick(piv, j, 0), _pick(piv, j, NP - 1)))
        scale = tl.where(inside, 2.0 / 0.0425 * (hi - lo) / gap, 4.0 * scale)
    return _grid(c, scale, NP)


@triton.jit
def _count(row, p0, p1, piv, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Column [NP, 1] int32: how many of row[p0:p1] are >= each pivot of the column ``piv``.
    [NP, BLOCK] tiles hold every pivot in every thread; counts stay per lane until the end (one
    cross-warp sum per pass), in float32 (exact below 2^24; a compare and a select-add per pivot,
    half the instructions of an int32 count); the next tile loads while this one is counted."""
    c = tl.zeros([NP, BLOCK], tl.float32)
    x = _load_x(row + p0 + tl.arange(0, BLOCK), p0 + tl.arange(0, BLOCK) < p1)
    for s in range(p0, p1, BLOCK):
        nxt = s + BLOCK + tl.arange(0, BLOCK)
        x_next = _load_x(row + nxt, nxt < p1)
        c += tl.where(x[None, :] >= piv, 1.0, 0.0)
        x = x_next
    return tl.sum(c, 1, keep_dims=True).to(tl.int32)


@triton.jit
def _bracket(c, piv, n, topk, NP: tl.constexpr):
    """From columns c (counts, non-increasing) and piv [NP, 1]: the pivot index jlo with
    c[jlo] >= topk > c[jlo + 1] (-1 when c[0] < topk), the bracket [lo, hi) (lo = -inf at jlo = -1;
    has_hi false at jlo = NP - 1), and count(>= lo), count(>= hi) (0 without hi)."""
    j = tl.arange(0, NP)[:, None]
    jlo = tl.max(tl.max(tl.where(c >= topk, j, -1), 1), 0)
    lo = tl.where(jlo >= 0, _pick(piv, j, jlo), float("-inf"))
    c_lo = tl.where(jlo >= 0, _pick(c, j, jlo), n)
    return lo, _pick(piv, j, jlo + 1), jlo + 1 < NP, c_lo, _pick(c, j, jlo + 1)


@triton.jit
def _compact(row, p0, p1, lo, hi, has_hi, d_base, c_base, out, cval, cpos, BLOCK: tl.constexpr):
    """row[p0:p1]: positions >= hi to out[d_base...], candidates in [lo, hi) to cval/cpos[c_base...]
    (value, position), each in position order. Loads the next tile while writing this one."""
    x = _load_x(row + p0 + tl.arange(0, BLOCK), p0 + tl.arange(0, BLOCK) < p1)
    for s in range(p0, p1, BLOCK):
        pos = s + tl.arange(0, BLOCK)
        ok = pos < p1
        x_next = _load_x(row + pos + BLOCK, pos + BLOCK < p1)
        top = ok & has_hi & (x >= hi)
        cand = ok & (x >= lo) & ~top
        both = top.to(tl.int32) + (cand.to(tl.int32) << 16)  # one scan for two counts (< 2^16 each)
        inc = tl.cumsum(both, 0)
        tl.store(out + d_base + (inc & 0xFFFF) - 1, pos, mask=top)
        c_off = c_base + (inc >> 16) - 1
        tl.store(cval + c_off, x, mask=cand)
        tl.store(cpos + c_off, pos, mask=cand)
        tot = tl.sum(both, 0)
        d_base += tot & 0xFFFF
        c_base += tot >> 16
        x = x_next


@triton.jit
def _radix(cval, m, r, lo, hi, has_hi, CB: tl.constexpr):
    """Signed key of the r-th largest of cval[0:m] (1 <= r <= m), and how many of the r largest
    equal it. Radix select, 8 bits a round, on the unsigned form of the key (sign bit flipped).
    Every candidate lies in [lo, hi) (no upper bound without has_hi), so their keys share the
    leading bits of key(lo) and key(hi) - 1: rounds inside that common prefix are skipped."""
    bins = tl.arange(0, 256)
    k_lo = _skey(lo) ^ -2147483648
    k_last = tl.where(has_hi & (hi == hi), (_skey(hi) ^ -2147483648) - 1, -1)  # -1: all ones
    same = k_lo ^ k_last  # zero in the bits every candidate shares
    prefix = m * 0  # the key bits fixed so far, unsigned form
    for rnd in tl.static_range(4):
        shift = 24 - 8 * rnd  # a constexpr: rnd is one
        d = (k_lo >> shift) & 255
        if (same >> shift) != 0:  # candidates differ in this digit: count them
            hist = tl.zeros([256], tl.int32)
            for s in range(0, m, CB):
                i = s + tl.arange(0, CB)
                ok = i < m
                uk = _skey(tl.load(cval + i, mask=ok, other=0.0)) ^ -2147483648
                if rnd > 0:
                    ok = ok & (((uk ^ prefix) >> (shift + 8)) == 0)
                hist += tl.histogram((uk >> shift) & 255, 256, mask=ok)
            ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
            d = tl.max(tl.where(ge >= r, bins, -1), 0)
            r -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d << shift)
    return prefix ^ -2147483648, r


@triton.jit
def _select(cval, cpos, m, r, lo, hi, has_hi, out, CB: tl.constexpr):
    """Write the positions of the r largest of the m candidates (cval/cpos, in [lo, hi)) to out[0:r]."""
    kth = m * 0 - 2147483647 - 1  # below every key: all m taken (r == m)
    r_eq = m * 0
    if r < m:
        kth, r_eq = _radix(cval, m, r, lo, hi, has_hi, CB)
    n_gt = m * 0
    n_eq = m * 0
    for s in range(0, m, CB):
        i = s + tl.arange(0, CB)
        ok = i < m
        sk = _skey(tl.load(cval + i, mask=ok, other=0.0))
        gt = ok & (sk > kth)
        eq = ok & (sk == kth)
        both = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        inc = tl.cumsum(both, 0)
        rank_eq = n_eq + (inc >> 16) - 1
        take = gt | (eq & (rank_eq < r_eq))
        dst = tl.where(gt, n_gt + (inc & 0xFFFF) - 1, r - r_eq + rank_eq)  # ties after the larger
        tl.store(out + dst, tl.load(cpos + i, mask=take, other=0), mask=take)
        tot = tl.sum(both, 0)
        n_gt += tot & 0xFFFF
        n_eq += tot >> 16


@triton.jit
def _finish(cval, cpos, c_lo, c_top, lo, hi, has_hi, out, pages, topk, PAGE: tl.constexpr,
            BLOCK: tl.constexpr, CB: tl.constexpr):
    """After the compact pass (out[0:c_top] holds the positions >= hi): select the rest from the
    candidates, then turn the row's positions into slots."""
    tl.debug_barrier()  # candidates and positions come from other threads (or programs)
    _select(cval, cpos, c_lo - c_top, topk - c_top, lo, hi, has_hi, out + c_top, CB)
    tl.debug_barrier()
    _to_slots(out, pages, topk, PAGE, BLOCK)


@triton.jit
def _topk_fused_kernel(logits, stride_l, lens, indptr, indices, out, cval, cpos, stride_c, topk,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr, S: tl.constexpr,
                       NP: tl.constexpr, ITERS: tl.constexpr):
    """Program b: request b whole (pivots, count, compact, select)."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens + b)
    o = out + b * topk
    pages = indices + tl.load(indptr + b)
    if n <= topk:
        _write_short(o, pages, n, topk, PAGE, BLOCK)
    else:
        row = logits + b * stride_l
        piv = _pivots(row, n, topk, S, NP, ITERS)
        lo, hi, has_hi, c_lo, c_top = _bracket(_count(row, 0, n, piv, NP, BLOCK), piv, n, topk, NP)
        cv, cp = cval + b * stride_c, cpos + b * stride_c
        _compact(row, 0, n, lo, hi, has_hi, n * 0, n * 0, o, cv, cp, BLOCK)
        _finish(cv, cp, c_lo, c_top, lo, hi, has_hi, o, pages, topk, PAGE, BLOCK, CB)


@triton.jit
def _chunk(n, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Positions per program when a request is split: n / SPLITS rounded up to whole tiles."""
    return tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK


@triton.jit
def _topk_count_kernel(logits, stride_l, lens, counts, pivots, topk, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr, S: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr):
    """Program (b, p): counts [B, SPLITS, NP] of chunk p of request b; p = 0 stores the pivots [B, NP]."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = tl.load(lens + b)
    if n > topk:
        row = logits + b * stride_l
        piv = _pivots(row, n, topk, S, NP, ITERS)  # the same in every program of the request
        chunk = _chunk(n, SPLITS, BLOCK)
        c = _count(row, tl.multiple_of(p * chunk, BLOCK), tl.minimum(n, (p + 1) * chunk), piv, NP, BLOCK)
        j = tl.arange(0, NP)[:, None]
        tl.store(counts + (b * SPLITS + p) * NP + j, c)
        tl.store(pivots + b * NP + j, piv, mask=(j < NP) & (p == 0))


@triton.jit
def _chunk_counts(counts, pivots, b, n, topk, SPLITS: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The count pass of request b read back: the bracket (lo, hi, has_hi), and per chunk q [SP]
    (SPLITS rounded up to a power of two) its index, its count >= lo and its count >= hi (0 past
    the last chunk)."""
    q = tl.arange(0, SP)
    j = tl.arange(0, NP)
    cnt = tl.load(counts + (b * SPLITS + q[:, None]) * NP + j[None, :], mask=q[:, None] < SPLITS, other=0)
    jlo = tl.max(tl.where(tl.sum(cnt, 0) >= topk, j, -1), 0)
    length = tl.minimum(tl.maximum(n - q * _chunk(n, SPLITS, BLOCK), 0), _chunk(n, SPLITS, BLOCK))
    q_lo = tl.where(jlo >= 0, tl.sum(tl.where(j[None, :] == jlo, cnt, 0), 1), length)
    q_top = tl.sum(tl.where(j[None, :] == jlo + 1, cnt, 0), 1)
    jc = tl.arange(0, NP)[:, None]
    piv = tl.load(pivots + b * NP + jc)
    lo = tl.where(jlo >= 0, _pick(piv, jc, jlo), float("-inf"))
    return lo, _pick(piv, jc, jlo + 1), jlo + 1 < NP, q, q_lo, q_top


@triton.jit
def _topk_compact_kernel(logits, stride_l, lens, out, cval, cpos, stride_c, counts, pivots, topk,
                         SPLITS: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    """Program (b, p): compaction of chunk p of request b, at offsets after chunks 0..p-1."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = tl.load(lens + b)
    if n > topk:
        lo, hi, has_hi, q, q_lo, q_top = _chunk_counts(counts, pivots, b, n, topk, SPLITS, SP, NP, BLOCK)
        chunk = _chunk(n, SPLITS, BLOCK)
        _compact(logits + b * stride_l, tl.multiple_of(p * chunk, BLOCK), tl.minimum(n, (p + 1) * chunk), lo,
                 hi, has_hi, tl.sum(tl.where(q < p, q_top, 0), 0), tl.sum(tl.where(q < p, q_lo - q_top, 0), 0),
                 out + b * topk, cval + b * stride_c, cpos + b * stride_c, BLOCK)


@triton.jit
def _topk_select_kernel(lens, indptr, indices, out, cval, cpos, stride_c, counts, pivots, topk, SPLITS: tl.constexpr,
                        SP: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr,
                        NP: tl.constexpr):
    """Program b: request b's short-context slots, or the selection among its candidates."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens + b)
    o = out + b * topk
    pages = indices + tl.load(indptr + b)
    if n <= topk:
        _write_short(o, pages, n, topk, PAGE, BLOCK)
    else:
        lo, hi, has_hi, q, q_lo, q_top = _chunk_counts(counts, pivots, b, n, topk, SPLITS, SP, NP, BLOCK)
        _finish(cval + b * stride_c, cpos + b * stride_c, tl.sum(q_lo, 0), tl.sum(q_top, 0), lo, hi, has_hi, o,
                pages, topk, PAGE, BLOCK, CB)


def _check(name, t, dtype, dims):
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {dtype}")


def auto_splits(batch_size: int, max_len: int, device) -> int:
    """Programs per request for passes 2-3: enough to fill the GPU's SMs, chunks of >= 4096
    positions, at most 32; 1 (one fused launch) on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms // max(batch_size, 1), max_len // 4096, 32))


def _resolve(logits, kv_lens, topk, splits, block, cand_block, sample):
    """Check the shared arguments; returns (splits, sample) with the defaults filled in."""
    _check("logits", logits, torch.float32, 2)
    _check("kv_lens", kv_lens, torch.int32, 1)
    B, T = logits.shape
    if kv_lens.numel() != B:
        raise ValueError(f"kv_lens has {kv_lens.numel()} entries; logits has B = {B} rows")
    if T > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r}: must be a positive integer")
    splits = auto_splits(B, T, logits.device) if splits is None else splits
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 256:
        raise ValueError(f"splits={splits!r}: must be an integer in 1..256, or None")
    sample = min(4096, max(256, triton.next_power_of_2(T // 32))) if sample is None else sample
    for name, v in (("block", block), ("cand_block", cand_block), ("sample", sample)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v!r}: must be a power of two >= 16")
    return splits, sample


def topk_select(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, *, splits: int | None = None,
                block: int = 1024, cand_block: int = 256, sample: int | None = None, num_warps: int = 8) -> torch.Tensor:
    """Global token slots of each request's ``topk`` largest logits.

    Parameters
    ----------
    logits : [B, max_len] torch.float32, rows contiguous (any row stride); positions >= kv_lens[b]
        are never read, so max_len >= max(kv_lens) is all they need (not checked on the device).
    kv_lens : [B] int32, context lengths (0 allowed); kv_indptr : [B + 1] int32; kv_indices : [nnz]
        int32 KV page ids (the decode batch's page table).
    page_size : KV page size (>= 1); topk : slots per request (>= 1).
    splits : programs per request for the count and compact passes (1: one fused launch; None:
        ``auto_splits``); block : logits per tile of those passes; cand_block : candidates per tile
        of the select pass; sample : logits sampled for the pivots (None: max_len / 32 within
        256..4096); all three powers of two >= 16; num_warps.

    Returns
    -------
    slots : [B, topk] torch.int32 global token ids; see the module docstring for order and -1.
    Scratch: 8 * B * max_len bytes (candidates), plus 68 * B * splits bytes when splits > 1.
    """
    splits, sample = _resolve(logits, kv_lens, topk, splits, block, cand_block, sample)
    _check("kv_indptr", kv_indptr, torch.int32, 1)
    _check("kv_indices", kv_indices, torch.int32, 1)
    B, T = logits.shape
    if kv_indptr.numel() != B + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries; expected B + 1 = {B + 1}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}: must be a positive integer")
    out = torch.empty(B, topk, dtype=torch.int32, device=logits.device)
    if B == 0:
        return out
    cap = T if T > topk else 1  # candidates per request: at most its context
    cval = torch.empty(B, cap, dtype=torch.float32, device=logits.device)
    cpos = torch.empty(B, cap, dtype=torch.int32, device=logits.device)
    tiles = dict(BLOCK=block, NP=NUM_PIVOTS, num_warps=num_warps)
    pivoting = dict(S=sample, ITERS=REFINE_ROUNDS)
    if splits == 1:
        _topk_fused_kernel[(B,)](logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, out, cval, cpos, cap,
                                 topk, PAGE=page_size, CB=cand_block, **pivoting, **tiles)
        return out
    counts, pivots = _count_pass(logits, kv_lens, topk, splits, pivoting, tiles)
    chunks = dict(SPLITS=splits, SP=triton.next_power_of_2(splits), PAGE=page_size)
    _topk_compact_kernel[(B, splits)](logits, logits.stride(0), kv_lens, out, cval, cpos, cap, counts, pivots,
                                      topk, SPLITS=splits, SP=chunks["SP"], **tiles)
    _topk_select_kernel[(B,)](kv_lens, kv_indptr, kv_indices, out, cval, cpos, cap, counts, pivots, topk, CB=cand_block,
                              **chunks, **tiles)
    return out


def _count_pass(logits, kv_lens, topk, splits, pivoting, tiles):
    """The count pass: counts int32 [B, splits, NUM_PIVOTS] and pivots float32 [B, NUM_PIVOTS]
    (rows of requests with kv_lens[b] <= topk are left unwritten)."""
    B = logits.shape[0]
    counts = torch.empty(B, splits, NUM_PIVOTS, dtype=torch.int32, device=logits.device)
    pivots = torch.empty(B, NUM_PIVOTS, dtype=torch.float32, device=logits.device)
    _topk_count_kernel[(B, splits)](logits, logits.stride(0), kv_lens, counts, pivots, topk, SPLITS=splits,
                                    **pivoting, **tiles)
    return counts, pivots


def candidates(logits, kv_lens, topk: int, *, sample: int | None = None, block: int = 1024,
               num_warps: int = 8) -> torch.Tensor:
    """How many logits of each request fall in its bracket [lo, hi) and so go through the radix
    select: int64 [B], 0 for a request with kv_lens[b] <= topk. A diagnostic of the pivots (the
    select pass's cost grows with it); same arguments as ``topk_select``."""
    _, sample = _resolve(logits, kv_lens, topk, 1, block, 16, sample)
    counts, _ = _count_pass(logits, kv_lens, topk, 1, dict(S=sample, ITERS=REFINE_ROUNDS),
                       dict(BLOCK=block, NP=NUM_PIVOTS, num_warps=num_warps))
    c = counts[:, 0].long()  # [B, NP], non-increasing along the pivots
    n = kv_lens.long()
    j = torch.arange(NUM_PIVOTS, device=c.device)
    jlo = torch.where(c >= topk, j, -1).amax(1)
    c_lo = torch.where(jlo >= 0, c.gather(1, jlo.clamp_min(0)[:, None])[:, 0], n)
    top = jlo + 1 < NUM_PIVOTS
    c_top = torch.where(top, c.gather(1, (jlo + 1).clamp_max(NUM_PIVOTS - 1)[:, None])[:, 0], 0)
    return torch.where(n > topk, c_lo - c_top, 0)
