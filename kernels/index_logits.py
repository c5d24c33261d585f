"""DSA lightning-indexer logits over a paged FP8 index-key cache, one Triton kernel.

For request b and each position p < kv_lens[b] of its context (token t = global id of p):

    logit[b, p] = k_scale[t] * sum_h weights[b, h] * relu(q_idx[b, h] . k_idx[t])

``weights`` already carries the query's FP8 scale (relu(s x) = s relu(x) for s > 0), so the dot
products are FP8 x FP8 with fp32 accumulation. Positions map to tokens through the KV page table
(t = kv_indices[kv_indptr[b] + p // page_size] * page_size + p % page_size), and tokens to index
keys through 64-token index pages: page t // 64, row t % 64, the page being a 64 x D FP8 block
followed by 64 fp32 scales. A program scores BLOCK_T positions of one request for all heads with
one FP8 ``tl.dot`` (tokens as M, heads as N), TILES such tiles in a software-pipelined loop (the
query read once per program); positions past a request's length get -inf.

Candidates (``candidates``, for ``labkit.kernels.topk_prefilter``): given a per-request threshold
t16 on the top 16 bits of each logit's key (``topk_select._key``), a program also keeps the logits
at or above it, and their global token slots: first in its own stretch of staging rows (no atomic
in the tile loop, where one a tile cost 20% of the kernel on an H100, run 20), then one atomic add
on the request's count reserves their places in the request's row and the program copies them
there, so the candidates come in no set order. The top-k then reads those (about 1.3 topk a
request) instead of the whole row.

Bytes moved per context token: D + 4 read (132 for D = 128), 4 B of page table per page_size
tokens, 4 written; q and weights once per program; with candidates 16 B more a candidate (staged,
then copied) and one atomic a program. FLOPs: 2 * H * D per token (+ 3 * H for the relu and the
weighting).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .topk_select import _check, _key

INDEX_PAGE = 64  # tokens per index-key page


@triton.jit
def _logits_of(k, scale, q_t, w):
    """Logits [BLOCK_T] f32 of keys k [BLOCK_T, D] fp8 with their scales [BLOCK_T] for the query q_t
    [D, H_PAD] fp8 and head weights w [H_PAD] f32: one FP8 dot over the heads, relu, weighted sum."""
    s = tl.dot(k, q_t)  # [BLOCK_T, H_PAD] f32, FP8 products exact, fp32 sums
    return tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * scale


@triton.jit
def _tile_logits(k_ptr, s_ptr, tok, q_t, w, stride_kp, stride_sp, IPAGE: tl.constexpr, D: tl.constexpr):
    """``_logits_of`` the tokens ``tok`` [BLOCK_T] (global ids), their keys gathered row by row."""
    ip, row = tok // IPAGE, tok % IPAGE
    k = tl.load(k_ptr + (ip * stride_kp + row * D)[:, None] + tl.arange(0, D)[None, :])  # [BLOCK_T, D] fp8
    return _logits_of(k, tl.load(s_ptr + ip * stride_sp + row), q_t, w)


@triton.jit
def _tile_logits_tma(k_desc, s_ptr, tok0, q_t, w, stride_sp, IPAGE: tl.constexpr, D: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """``_logits_of`` BLOCK_T consecutive tokens from tok0 (a multiple of IPAGE): whole index pages,
    whose keys come by one TMA copy (a [BLOCK_T / IPAGE, IPAGE, D] box of the page-strided keys)."""
    ip = (tok0 // IPAGE).to(tl.int32)
    k = k_desc.load([ip, 0, 0]).reshape(BLOCK_T, D)
    j = tl.arange(0, BLOCK_T)
    return _logits_of(k, tl.load(s_ptr + (ip + j // IPAGE).to(tl.int64) * stride_sp + j % IPAGE), q_t, w)


@triton.jit
def _index_logits_kernel(
    q_ptr,  # *fp8e4nv [B, H_PAD, D], contiguous; heads >= H are zero
    w_ptr,  # *f32 [B, H_PAD], contiguous; heads >= H are zero
    k_ptr,  # *fp8e4nv index keys: page stride stride_kp, row stride D, values contiguous
    k_desc,  # TMA: a descriptor of the same keys, [index pages, IPAGE, D], box [BLOCK_T / IPAGE, IPAGE, D]
    s_ptr,  # *f32 index-key scales: page stride stride_sp, rows contiguous
    indptr_ptr,  # *i32 [B + 1]
    indices_ptr,  # *i32 [nnz] KV page ids
    lens_ptr,  # *i32 [B]
    out_ptr,  # *f32 [B, max_len]
    max_len,
    stride_kp,  # elements (bytes) between index pages in k_ptr
    stride_sp,  # fp32 elements between index pages in s_ptr
    t16_ptr,  # *i32 [B] candidates' thresholds (CAND)
    crow_ptr,  # *f32 [B, stride_c] candidates' logits (CAND)
    cslot_ptr,  # *i32 [B, stride_c] their token slots (CAND)
    count_ptr,  # *i32 [B] candidates so far, zero before the launch (CAND)
    seg_row_ptr,  # *f32 [B, stride_c] staging: program p's candidates from position p * TILES * BLOCK_T (CAND)
    seg_slot_ptr,  # *i32 [B, stride_c] their slots (CAND)
    stride_c,
    PAGE: tl.constexpr,  # KV page size
    IPAGE: tl.constexpr,  # index page size (64)
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES: tl.constexpr,  # tiles of BLOCK_T positions per program
    NUM_STAGES: tl.constexpr,  # their loads in flight (tl.range's software pipelining)
    CAND: tl.constexpr,  # also append the logits at or above t16 to the candidates
    COPY: tl.constexpr,  # a power of two >= TILES * BLOCK_T (CAND)
    TMA: tl.constexpr,  # keys by TMA (PAGE a multiple of BLOCK_T, BLOCK_T of IPAGE): a tile is whole index pages
):
    pid_t, b = tl.program_id(0), tl.program_id(1)
    n = tl.load(lens_ptr + b)
    start = tl.load(indptr_ptr + b)
    d = tl.arange(0, D)
    h = tl.arange(0, H_PAD)
    q_t = tl.load(q_ptr + b * H_PAD * D + h[None, :] * D + d[:, None])  # [D, H_PAD] fp8, once per program
    w = tl.load(w_ptr + b * H_PAD + h)  # [H_PAD] f32
    t0 = pid_t * TILES
    if CAND:
        t16 = tl.load(t16_ptr + b)
        crow = crow_ptr + b.to(tl.int64) * stride_c
        cslot = cslot_ptr + b.to(tl.int64) * stride_c
        seg = t0 * BLOCK_T  # this program's own stretch of the staging rows: no atomics in the loop
        srow, sslot = seg_row_ptr + b.to(tl.int64) * stride_c + seg, seg_slot_ptr + b.to(tl.int64) * stride_c + seg
        c = seg * 0
    live = tl.minimum(tl.maximum(tl.cdiv(n, BLOCK_T) - t0, 0), TILES)  # tiles that hold context
    for t in tl.range(0, live, num_stages=NUM_STAGES):
        p0 = (t0 + t) * BLOCK_T
        pos = p0 + tl.arange(0, BLOCK_T)  # [BLOCK_T] positions in the context
        if TMA:  # the tile is within one KV page: its tokens are consecutive
            tok0 = tl.load(indices_ptr + start + p0 // PAGE).to(tl.int64) * PAGE + p0 % PAGE
            tok = tok0 + tl.arange(0, BLOCK_T)
            logit = _tile_logits_tma(k_desc, s_ptr, tok0, q_t, w, stride_sp, IPAGE, D, BLOCK_T)
        else:
            pc = tl.minimum(pos, n - 1)  # dead lanes re-read the last token: no masked loads
            page = tl.load(indices_ptr + start + pc // PAGE).to(tl.int64)
            tok = page * PAGE + pc % PAGE  # [BLOCK_T] global token ids
            logit = _tile_logits(k_ptr, s_ptr, tok, q_t, w, stride_kp, stride_sp, IPAGE, D)
        logit = tl.where(pos < n, logit, float("-inf"))
        tl.store(out_ptr + b * max_len + pos, logit, mask=pos < max_len)
        if CAND:
            keep = (pos < n) & (((_key(logit) >> 16) & 0xFFFF) >= t16)
            ki = keep.to(tl.int32)
            dst = c + tl.cumsum(ki, 0) - 1
            tl.store(srow + dst, logit, mask=keep)
            tl.store(sslot + dst, tok.to(tl.int32), mask=keep)
            c += tl.sum(ki, 0)
    if CAND:  # one atomic a program reserves its places in the request's row; then a copy from L2
        base = tl.atomic_add(count_ptr + b, c)
        tl.debug_barrier()  # the staged candidates were stored by other threads of this program
        i = tl.arange(0, COPY)
        tl.store(crow + base + i, tl.load(srow + i, mask=i < c), mask=i < c)
        tl.store(cslot + base + i, tl.load(sslot + i, mask=i < c), mask=i < c)
    for t in range(live, TILES):  # tiles wholly past this request's context (a longer one sets the grid)
        pos = (t0 + t) * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_ptr + b * max_len + pos, tl.full([BLOCK_T], float("-inf"), tl.float32), mask=pos < max_len)


def auto_tiles(batch: int, max_len: int, block_t: int, device) -> int:
    """Tiles per program: as many as leave about four programs per SM (fewer programs, each loading
    the query once and keeping two tiles of keys in flight), at most 8; 1 on a CPU. On the H200 (run
    10) 8 tiles, 2 stages took 80.9 us at 64 x 32K against 83.4 with one tile a program (3-5% at 64
    requests); at one request more than one tile a program was slower (1 x 32K: 4.1 us with one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = batch * triton.cdiv(max_len, block_t) // (4 * sms)
    return max(1, min(8, 1 << max(tiles, 1).bit_length() - 1))


def index_logits(q_idx, weights, k_idx, k_scale, kv_indptr, kv_indices, kv_lens, page_size: int,
                 max_len: int, *, block_t: int = 64, tiles: int | None = None, num_stages: int | None = None,
                 num_warps: int = 4, candidates: tuple | None = None, tma: bool = False) -> torch.Tensor:
    """Indexer logits of a decode batch, read straight from the paged FP8 index cache.

    Parameters
    ----------
    q_idx : [B, H, D] torch.float8_e4m3fn, the quantized index query (its scale is in ``weights``).
    weights : [B, H] torch.float32, head weights times the query's scale.
    k_idx : [num_index_pages, 64, D] torch.float8_e4m3fn, rows contiguous (any page stride: a
        view into the packed 64 * (D + 4)-byte pages).
    k_scale : [num_index_pages, 64] torch.float32, rows contiguous (any page stride).
    kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 KV page ids; kv_lens : [B] int32, each >= 1
        (not checked on the device).
    page_size : KV page size (a power of two); max_len : max(kv_lens), known on the host.
    block_t, tiles, num_stages, num_warps : tuning (positions per tile, a power of two >= 16; tiles
        per program, None: ``auto_tiles``; tiles in flight, None: 2, or 1 with one tile; warps).
    candidates : None, or (t16, crow, cslot, count): t16 [B] int32 thresholds (0..65536, 65536 keeps
        none), crow [B, C] float32 and cslot [B, C] int32 with C >= max_len (rows contiguous),
        count [B] int32, zero before the call: request b's logits whose keys' top 16 bits are >=
        t16[b] are appended to crow[b] (their token slots to cslot[b]) in no set order, and
        count[b] ends as how many (module docstring). Staging rows as large as crow and cslot are
        allocated for the call.
    tma : the keys by TMA, a tile of whole index pages a copy (``block_t`` 64 or 128 and a multiple of
        the page, ``page_size`` a multiple of ``block_t``, k_idx 16-byte aligned) instead of row by row.

    Returns
    -------
    logits : [B, max_len] torch.float32, -inf at positions >= kv_lens[b].
    """
    _check("q_idx", q_idx, torch.float8_e4m3fn, 3)
    _check("weights", weights, torch.float32, 2)
    _check("k_idx", k_idx, torch.float8_e4m3fn, 3)
    _check("k_scale", k_scale, torch.float32, 2)
    B, H, D = q_idx.shape
    if tuple(weights.shape) != (B, H):
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected (B, H) = {(B, H)}")
    if k_idx.shape[1:] != (INDEX_PAGE, D) or k_idx.stride()[1:] != (D, 1):
        raise ValueError(f"k_idx must be [num_index_pages, {INDEX_PAGE}, {D}] with contiguous rows, got "
                         f"{tuple(k_idx.shape)} strides {k_idx.stride()}")
    if tuple(k_scale.shape) != (k_idx.shape[0], INDEX_PAGE) or k_scale.stride(1) != 1:
        raise ValueError(f"k_scale must be [{k_idx.shape[0]}, {INDEX_PAGE}] with contiguous rows")
    if D & (D - 1) or D < 16:
        raise ValueError(f"q_idx: head dim {D} must be a power of two >= 16")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: must be a power of two")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t}: must be a power of two >= 16")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        _check(name, t, torch.int32, 1)
    if tma and (block_t not in (64, 128) or page_size % block_t or k_idx.data_ptr() % 16 or k_idx.stride(0) % 16):
        raise ValueError(f"tma=True reads tiles of whole index pages: block_t must be 64 or 128 and divide "
                         f"page_size, k_idx 16-byte aligned; got block_t={block_t}, page_size={page_size}, "
                         f"page stride {k_idx.stride(0)} B, address mod 16 = {k_idx.data_ptr() % 16}")
    q, w = pad_heads(q_idx, weights)  # tl.dot needs N >= 16
    out = torch.empty(B, max_len, dtype=torch.float32, device=q_idx.device)
    if B == 0 or max_len == 0:
        return out
    cand = _check_candidates(candidates, B, max_len, kv_lens)
    tiles = auto_tiles(B, max_len, block_t, q_idx.device) if tiles is None else tiles
    if isinstance(tiles, bool) or not isinstance(tiles, int) or not 1 <= tiles <= 256:
        raise ValueError(f"tiles={tiles!r}: must be an integer in 1..256, or None")
    num_stages = (2 if tiles > 1 else 1) if num_stages is None else num_stages
    staging = (torch.empty_like(cand[1]), torch.empty_like(cand[2])) if candidates is not None else cand[:2]
    grid = (triton.cdiv(max_len, block_t * tiles), B)
    k_desc = TensorDescriptor.from_tensor(k_idx, [block_t // INDEX_PAGE, INDEX_PAGE, D]) if tma else k_idx
    _index_logits_kernel[grid](
        q, w, k_idx, k_desc, k_scale, kv_indptr, kv_indices, kv_lens, out, max_len,
        k_idx.stride(0), k_scale.stride(0), *cand, *staging, cand[1].stride(0) if candidates is not None else 0,
        PAGE=page_size, IPAGE=INDEX_PAGE, D=D, H_PAD=q.shape[1], BLOCK_T=block_t, TILES=tiles, NUM_STAGES=num_stages,
        CAND=candidates is not None, COPY=triton.next_power_of_2(tiles * block_t), TMA=bool(tma),
        num_warps=num_warps,
    )
    return out


def pad_heads(q_idx, weights):
    """q_idx [B, H, D] fp8 and weights [B, H] with the heads zero-padded to H_PAD = max(16, the next
    power of two) (``tl.dot`` needs N >= 16); as given, contiguous, at GLM-5's 32 heads (two fewer
    launches, four in a graph)."""
    B, H, D = q_idx.shape
    h_pad = max(16, triton.next_power_of_2(H))
    if h_pad == H:
        return q_idx.contiguous(), weights.contiguous()
    q = torch.zeros(B, h_pad, D, dtype=torch.uint8, device=q_idx.device)  # zero bytes = +0.0 in e4m3
    q[:, :H] = q_idx.view(torch.uint8)
    w = torch.zeros(B, h_pad, dtype=torch.float32, device=q_idx.device)
    w[:, :H] = weights
    return q.view(torch.float8_e4m3fn), w


def _check_candidates(candidates, B: int, max_len: int, placeholder) -> tuple:
    """The kernel's four candidate pointers (``placeholder``, never read, when there are none)."""
    if candidates is None:
        return (placeholder,) * 4
    if not isinstance(candidates, (tuple, list)) or len(candidates) != 4:
        raise ValueError("candidates must be a tuple (t16, crow, cslot, count)")
    t16, crow, cslot, count = candidates
    for name, t, dtype, dims in (("t16", t16, torch.int32, 1), ("crow", crow, torch.float32, 2),
                                 ("cslot", cslot, torch.int32, 2), ("count", count, torch.int32, 1)):
        _check(name, t, dtype, dims)
    if t16.numel() != B or count.numel() != B:
        raise ValueError(f"t16 and count must have B = {B} entries, got {t16.numel()} and {count.numel()}")
    if crow.shape != cslot.shape or crow.shape[0] != B or crow.shape[1] < max_len or crow.stride(1) != 1 \
            or cslot.stride() != crow.stride():
        raise ValueError(f"crow and cslot must be [B, >= max_len] = [{B}, >= {max_len}] with the same contiguous "
                         f"rows, got {tuple(crow.shape)} and {tuple(cslot.shape)}")
    return t16, crow, cslot, count
