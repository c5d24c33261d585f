"""The DSA lightning indexer of GLM-5: per layer, score every context token, keep the top-k.

For request b (one decode query) and each token t of its context, per layer:

    logit[b, t] = k_scale[t] * sum_h weights[b, h] * relu(q_idx[b, h] . k_idx[t])

with ``index_n_heads`` (32) heads of ``index_head_dim`` (128) values; MLA then attends only to
the ``index_topk`` (2048) best tokens: all of them when the context is shorter, -1 padding after.

Index-key cache, per layer: every token of the KV pool (global id t = page_id * page_size + slot,
the rows of ``KVPool.rows``) has one key of D FP8 e4m3 values and one fp32 scale (real = e4m3 *
scale, scale = amax / 448 per token): 132 B for D = 128. Keys live in index pages of 64 tokens,
whatever the KV page size: token t is row t % 64 of index page t // 64, a page being the 64 x D
FP8 block followed by the 64 scales (8448 B), not interleaved:

    IndexCache.buffer  uint8 [num_layers, num_index_pages, 64 * (D + 4)]
    .k_idx(layer)      float8_e4m3fn [num_index_pages, 64, D]   (views of the same bytes)
    .k_scale(layer)    float32 [num_index_pages, 64]

The query q_idx [B, H, D] is quantized to FP8 with one scale per request, and that scale is
folded into the head weights (relu(s x) = s relu(x) for s > 0), as DeepSeek-V3.2's reference
indexer does. Three implementations of the logits: "reference" (float64 on the same FP8 values),
"torch" (keys widened, einsum, relu, weighted sum) and "triton" (labkit.kernels.index_logits,
reading the paged cache directly). Slots: int32 [B, index_topk] global token ids, validated by
``check_slots``; ``Indexer.step_slots`` gives [num_layers, B, index_topk] for ``DecodeBatch``. Three
implementations of the top-k (``topk_impl``): "torch" (``torch.topk``), "triton"
(labkit.kernels.topk_select) and, on CUDA only, "cuda" (labkit.kernels.topk_cuda); None picks
``default_topk_impl``: where it measured faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .kvlayout import E4M3_MAX
from .kvpool import DecodeBatch, KVPool

INDEX_PAGE = 64  # tokens per index-key page


def index_page_bytes(head_dim: int = 128) -> int:
    """Bytes of one index page: 64 x head_dim FP8 values + 64 fp32 scales (8448 for 128)."""
    return INDEX_PAGE * (head_dim + 4)


def index_bytes(context_tokens: int, head_dim: int = 128) -> int:
    """Bytes one layer of the indexer must read for ``context_tokens`` (summed over requests):
    head_dim + 4 per token (132), the key and its scale. Logits, q and weights are not counted."""
    return context_tokens * (head_dim + 4)


def index_flops(context_tokens: int, n_heads: int = 32, head_dim: int = 128) -> int:
    """FLOPs of one layer of the indexer's dot products: 2 * n_heads * head_dim per token."""
    return 2 * n_heads * head_dim * context_tokens


# -- quantization ------------------------------------------------------------------------------
def quantize_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] real -> (k_idx [..., D] float8_e4m3fn, k_scale [...] float32), scale = amax / 448
    per token, real ~= k_idx * k_scale."""
    scale = x.float().abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    q = (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_index_query(q_idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_idx [..., B, H, D] real, weights [..., B, H] -> (q_idx [..., B, H, D] float8_e4m3fn,
    weights [..., B, H] float32 times the query's scale): one scale per request (amax / 448)."""
    scale = q_idx.float().abs().amax((-2, -1)).clamp_min(1e-12) / E4M3_MAX  # [..., B]
    q8 = (q_idx.float() / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q8, weights.float() * scale[..., None]


# -- the cache ---------------------------------------------------------------------------------
@dataclass
class IndexCache:
    """Index keys of every layer: buffer uint8 [num_layers, num_index_pages, 64 * (head_dim + 4)]."""

    buffer: torch.Tensor
    head_dim: int = 128

    def __post_init__(self):
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 3:
            raise ValueError(f"buffer must be uint8 [num_layers, num_index_pages, page_bytes], got "
                             f"{self.buffer.dtype} {tuple(self.buffer.shape)}")
        if self.buffer.shape[2] != index_page_bytes(self.head_dim):
            raise ValueError(f"buffer pages hold {self.buffer.shape[2]} B; head_dim={self.head_dim} "
                             f"needs {index_page_bytes(self.head_dim)}")

    @property
    def num_layers(self) -> int:
        return self.buffer.shape[0]

    @property
    def num_index_pages(self) -> int:
        return self.buffer.shape[1]

    @property
    def tokens(self) -> int:
        return self.num_index_pages * INDEX_PAGE

    def k_idx(self, layer: int) -> torch.Tensor:
        """[num_index_pages, 64, head_dim] float8_e4m3fn, a view (page stride = page bytes)."""
        block = self.buffer[layer, :, : INDEX_PAGE * self.head_dim]
        return block.view(torch.float8_e4m3fn).unflatten(-1, (INDEX_PAGE, self.head_dim))

    def k_scale(self, layer: int) -> torch.Tensor:
        """[num_index_pages, 64] float32, a view."""
        return self.buffer[layer, :, INDEX_PAGE * self.head_dim :].view(torch.float32)

    def keys(self, layer: int, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [...] int (>= 0) -> (k_idx [..., head_dim] float8_e4m3fn, k_scale [...] float32)."""
        t = token_ids.long()
        ip, row = t // INDEX_PAGE, t % INDEX_PAGE
        return self.k_idx(layer)[ip, row], self.k_scale(layer)[ip, row]


def random_index_cache(pool: KVPool, head_dim: int = 128, seed: int = 0) -> IndexCache:
    """Random index keys for every layer and token of ``pool`` (seeded), quantized per token."""
    n_pages = -(-pool.pool_tokens // INDEX_PAGE)
    buf = torch.empty(pool.num_layers, n_pages, index_page_bytes(head_dim), dtype=torch.uint8,
                      device=pool.device)
    cache = IndexCache(buf, head_dim)
    gen = torch.Generator(device=pool.device).manual_seed(seed + 104729)
    for layer in range(pool.num_layers):
        x = torch.randn(n_pages, INDEX_PAGE, head_dim, generator=gen, device=pool.device)
        k8, scale = quantize_index_keys(x * (0.5 + 0.25 * (layer % 4)))
        cache.k_idx(layer).copy_(k8)
        cache.k_scale(layer).copy_(scale)
    return cache


# -- logits --------------------------------------------------------------------------------------
def token_ids(batch: DecodeBatch, positions: torch.Tensor) -> torch.Tensor:
    """positions [B, N] int (context positions of each request, any value) -> [B, N] int64 global
    token ids, -1 where the position is < 0 or >= kv_lens[b]."""
    ps = batch.page_size
    pos = positions.long()
    valid = (pos >= 0) & (pos < batch.kv_lens.long()[:, None])
    entry = (batch.kv_indptr[:-1].long()[:, None] + pos.clamp_min(0) // ps).clamp_max(batch.num_pages - 1)
    ids = batch.kv_indices.long()[entry] * ps + pos.clamp_min(0) % ps
    return torch.where(valid, ids, torch.full_like(ids, -1))


def positions_of(batch: DecodeBatch, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of ``token_ids``: slots [B, K] int (global token ids, -1 = none) -> [B, K] int64
    context positions, -1 where a slot is -1 or not a token of its request's context."""
    ids = _context_ids(batch).to(slots.device)  # [B, max_len]
    srt, order = torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max).sort(1)
    s = slots.long()
    at = torch.searchsorted(srt, s.clamp_min(0)).clamp_max(ids.shape[1] - 1)
    return torch.where((srt.gather(1, at) == s) & (s >= 0), order.gather(1, at), -1)


def _context_ids(batch: DecodeBatch) -> torch.Tensor:
    pos = torch.arange(batch.max_len, device=batch.kv_lens.device).expand(batch.batch_size, -1)
    return token_ids(batch, pos)  # [B, max_len]


def logits_reference(q_idx, weights, cache: IndexCache, layer: int, batch: DecodeBatch) -> torch.Tensor:
    """The oracle: float64 math, one request at a time, on the stored FP8 values.
    q_idx [B, H, D] float8_e4m3fn, weights [B, H] float32 -> [B, max_len] float64, -inf past each length."""
    out = torch.full((batch.batch_size, batch.max_len), float("-inf"), dtype=torch.float64,
                     device=q_idx.device)
    ids = _context_ids(batch)
    for b, n in enumerate(batch.lens_host):
        k, scale = cache.keys(layer, ids[b, :n])  # [n, D], [n]
        s = torch.relu(q_idx[b].double() @ k.double().T)  # [H, n]
        out[b, :n] = scale.double() * (weights[b].double() @ s)
    return out


def logits_torch(q_idx, weights, cache: IndexCache, layer: int, batch: DecodeBatch) -> torch.Tensor:
    """Batched torch: gather the keys, widen to fp32, einsum, relu, weighted sum over heads.
    Same shapes as ``logits_reference``; returns float32."""
    ids = _context_ids(batch)
    k, scale = cache.keys(layer, ids.clamp_min(0))  # [B, T, D] fp8, [B, T]
    s = torch.relu(torch.einsum("bhd,btd->bht", q_idx.float(), k.float()))
    out = torch.einsum("bh,bht->bt", weights.float(), s) * scale
    return out.masked_fill(ids < 0, float("-inf"))


def logits_triton(q_idx, weights, cache: IndexCache, layer: int, batch: DecodeBatch, **tuning) -> torch.Tensor:
    """The Triton kernel (labkit.kernels.index_logits) on the paged cache; float32 [B, max_len]."""
    from .kernels.index_logits import index_logits

    return index_logits(q_idx, weights, cache.k_idx(layer), cache.k_scale(layer), batch.kv_indptr,
                        batch.kv_indices, batch.kv_lens, batch.page_size, batch.max_len, **tuning)


LOGITS = {"reference": logits_reference, "torch": logits_torch, "triton": logits_triton}


@dataclass
class SampleTable:
    """Where the top-k's threshold samples each request's logits (``kernels.topk_prefilter``), as a
    page table of page size 1 over the sampled tokens: kv_indptr [B + 1] int32 (b * sample),
    kv_indices [B * sample] int32 global token ids (-1 past S), kv_lens [B] int32 S = min(n, sample).
    Made once per batch (``sample_table``); every layer's indexer reads the same positions."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    sample: int


# The candidates (topk_impl="candidates") measured on the H200 (run 21a, us a layer, logits + top-k):
# 64 x 32K 141.8 against 131.4 for the radix top-k after the logits, 1 x 32K 28.7 against 17.7, 64 x
# 128K 433.1 against 455.4. So they are off by default.
CAND_SAMPLE = 1024  # logits sampled per request for the candidates' threshold
# The select over the candidates: by passes over memory (0), which measured faster than the register
# select (``topk_select(..., regs=4096)``) at every shape of run 21a: 141.8 / 149.4 us at 64 x 32K,
# 28.7 / 31.1 at 1 x 32K, 433.1 / 457.3 at 64 x 128K.
CAND_REGS = 0


def sample_table(batch: DecodeBatch, sample: int = CAND_SAMPLE, run: int = 1) -> SampleTable:
    """The sampled positions of every request of ``batch`` (``kernels.topk_prefilter.sample_positions``:
    j * n // S for j < S = min(n, sample), or runs of ``run`` consecutive positions)."""
    from .kernels.topk_prefilter import sample_positions

    if isinstance(sample, bool) or not isinstance(sample, int) or not 16 <= sample <= 8192 or sample & (sample - 1):
        raise ValueError(f"sample={sample!r}: must be a power of two in 16..8192")
    pos, S = sample_positions(batch.kv_lens, sample, run)
    ids = token_ids(batch, pos).to(torch.int32).reshape(-1)
    indptr = torch.arange(batch.batch_size + 1, dtype=torch.int32, device=ids.device) * sample
    return SampleTable(indptr, ids, S, sample)


def logits_with_candidates(q_idx, weights, cache: IndexCache, layer: int, batch: DecodeBatch, index_topk: int,
                           table: SampleTable, **tuning) -> tuple[torch.Tensor, tuple]:
    """The logits (as ``logits_triton``) and, appended by the same kernel, each request's top-k
    candidates: the logits at ``table``'s sampled positions give each request a threshold (one
    launch, ``kernels.index_sample``), and the logits kernel keeps those at or above it (about 1.3
    index_topk a request) as it writes the row. Two launches. Returns (logits float32 [B, max_len],
    candidates), the latter for ``slots_from_candidates``. ``tuning``: index_logits'."""
    from .kernels.index_logits import index_logits
    from .kernels.index_sample import index_sample_threshold

    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk={index_topk!r}: must be a positive integer")
    if table.kv_lens.shape[0] != batch.batch_size:
        raise ValueError(f"table has {table.kv_lens.shape[0]} requests; the batch has {batch.batch_size}")
    k, ks, B, T = cache.k_idx(layer), cache.k_scale(layer), batch.batch_size, batch.max_len
    _, t16, count = index_sample_threshold(q_idx, weights, k, ks, table.kv_indices, batch.kv_lens, table.sample,
                                           index_topk)
    crow = torch.empty(B, T, dtype=torch.float32, device=t16.device)
    cslot = torch.empty(B, T, dtype=torch.int32, device=t16.device)
    logits = index_logits(q_idx, weights, k, ks, batch.kv_indptr, batch.kv_indices, batch.kv_lens, batch.page_size,
                          T, candidates=(t16, crow, cslot, count), **tuning)
    return logits, (crow, cslot, count)


def slots_from_candidates(logits: torch.Tensor, batch: DecodeBatch, index_topk: int, candidates: tuple,
                          **select) -> torch.Tensor:
    """Slots int32 [B, index_topk] (as ``select_tokens``) from ``logits_with_candidates``' output: the
    fallback of every request whose candidates fell short (its whole row, in context order), then the
    radix select over the candidates, one program a request (``topk_select``'s ``regs``:
    ``CAND_REGS``, passes over memory). Two launches; exact. ``select``: ``topk_select``'s tuning
    (block, cand_block, digit_bits, num_warps, regs)."""
    from .kernels.topk_prefilter import finish_candidates
    from .kernels.topk_select import topk_select

    crow, cslot, count, starts = finish_candidates(logits, batch.kv_lens, batch.kv_indptr, batch.kv_indices,
                                                   batch.page_size, index_topk, *candidates)
    select = {"regs": CAND_REGS, **select}
    return topk_select(crow, count, starts, cslot.view(-1), 1, index_topk, splits=1, count="histogram", **select)


def logits_and_slots(q_idx, weights, cache: IndexCache, layer: int, batch: DecodeBatch, index_topk: int,
                     table: SampleTable, select: dict | None = None, **tuning) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits_with_candidates`` (``tuning``) then ``slots_from_candidates`` (``select``): (logits
    [B, max_len] float32, slots [B, index_topk] int32), four launches, exact (a request whose sample
    misses keeps its row)."""
    logits, cand = logits_with_candidates(q_idx, weights, cache, layer, batch, index_topk, table, **tuning)
    return logits, slots_from_candidates(logits, batch, index_topk, cand, **(select or {}))


# -- top-k slots ---------------------------------------------------------------------------------
TOPK_IMPLS = ("torch", "triton", "cuda")


def default_topk_impl(device, batch_size: int | None = None, max_len: int | None = None) -> str:
    """The top-k when none is named. On a CPU ``torch.topk`` (a kernel would run in Triton's slow
    interpreter). On CUDA the CUDA C kernel (labkit.kernels.topk_cuda, one block a request) where
    it measured faster than the Triton radix select, which splits a row over many programs: from 32
    requests at any length, and from 8 requests of at most 32K (H100, runs 25c-d, us: 64 x 32K 17.2
    against 47.2, 64 x 128K 79.5 against 156.6, 32 x 128K 75.3 against 84.5, 128 x 32K 20.6 against
    80.2, 16 x 32K 16.7 against 22.2, 8 x 32K 16.8 against 17.9); below that the Triton kernel (16 x
    128K 48.4 against 72.0, one request of 32K 15.2 against 15.9, of 128K 18.6 against 70.9), and
    wherever NVRTC cannot compile the CUDA kernel. Both beat the "torch" path (``torch.topk``, then
    positions to token slots) at every shape measured."""
    if torch.device(device).type != "cuda":
        return "torch"
    from .kernels.topk_cuda import available

    many = batch_size is not None and (batch_size >= 32 or (batch_size >= 8 and max_len is not None
                                                             and max_len <= 32768))
    return "cuda" if many and available(device) else "triton"


def select_tokens(logits: torch.Tensor, batch: DecodeBatch, index_topk: int, check: bool = True,
                  topk_impl: str | None = None) -> torch.Tensor:
    """logits [B, max_len] (-inf past each length) -> slots int32 [B, index_topk]: global token ids
    of each request's best tokens, unsorted; a request with kv_lens[b] <= index_topk gets all its
    tokens in context order, then -1. ``topk_impl``: "torch" (``torch.topk``), "triton"
    (labkit.kernels.topk_select), "cuda" (labkit.kernels.topk_cuda, CUDA devices only; both kernels
    round float64 logits to float32 first) or None
    (``default_topk_impl``). Ties at the k-th logit may pick different tokens in each."""
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk={index_topk!r}: must be a positive integer")
    if topk_impl is None:
        topk_impl = default_topk_impl(logits.device, batch.batch_size, batch.max_len)
    if topk_impl == "candidates":
        raise ValueError("topk_impl='candidates' needs the logits kernel, not finished logits: use "
                         "Indexer.topk(layer, 'triton', topk_impl='candidates') or logits_and_slots")
    if topk_impl not in TOPK_IMPLS:
        raise ValueError(f"topk_impl={topk_impl!r}; allowed: {list(TOPK_IMPLS)} or None")
    if topk_impl in ("triton", "cuda"):
        slots = _slots_kernel(logits, batch, index_topk, topk_impl)
        if check:
            check_slots(batch, slots)
        return slots
    B, T = logits.shape
    pos = torch.arange(index_topk, device=logits.device).expand(B, -1)
    if T > index_topk:
        short = batch.kv_lens.to(logits.device)[:, None] <= index_topk
        pos = torch.where(short, pos, torch.topk(logits, index_topk, dim=1, sorted=False).indices)
    slots = token_ids(batch, pos).to(torch.int32)
    if check:
        check_slots(batch, slots)
    return slots


def _slots_kernel(logits: torch.Tensor, batch: DecodeBatch, index_topk: int, topk_impl: str) -> torch.Tensor:
    from .kernels.topk_cuda import topk_cuda
    from .kernels.topk_select import topk_select

    if logits.dim() != 2 or logits.shape[0] != batch.batch_size or logits.shape[1] < batch.max_len:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; the batch needs ({batch.batch_size}, "
                         f">= {batch.max_len}) (requests, longest context)")
    fn = topk_cuda if topk_impl == "cuda" else topk_select
    return fn(logits.float(), batch.kv_lens, batch.kv_indptr, batch.kv_indices, batch.page_size, index_topk)


def _at(mask: torch.Tensor, token_indices: torch.Tensor) -> str:
    """The first True position of ``mask`` [L, B, K] as an index of token_indices, and its value."""
    l, b, j = (int(i) for i in mask.nonzero()[0])
    where = f"[{b}, {j}]" if token_indices.dim() == 2 else f"[{l}, {b}, {j}]"
    return f"token_indices{where} = {int(token_indices.reshape(mask.shape)[l, b, j])} (request {b})"


def check_slots(batch: DecodeBatch, token_indices: torch.Tensor, pool_tokens: int | None = None) -> None:
    """Raise ValueError unless ``token_indices`` (int32 [B, topk] or [num_layers, B, topk]) holds, per
    request, distinct global ids of tokens inside its own pages and context, -1 only as a suffix."""
    t = token_indices
    if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or t.dtype != torch.int32:
        raise ValueError(f"token_indices must be int32 [B, topk] or [num_layers, B, topk], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.shape[-2] != batch.batch_size:
        raise ValueError(f"token_indices has {t.shape[-2]} requests; the batch has {batch.batch_size}")
    s = t.reshape(-1, *t.shape[-2:]).long()  # [L, B, K]
    if (s < -1).any():
        raise ValueError(f"{_at(s < -1, t)}: ids are >= 0, or -1 for an unused slot")
    if pool_tokens is not None and (s >= pool_tokens).any():
        raise ValueError(f"{_at(s >= pool_tokens, t)}: past the pool's {pool_tokens} tokens")
    unused = s < 0
    gap = torch.zeros_like(unused)
    gap[..., 1:] = unused[..., :-1] & ~unused[..., 1:]
    if gap.any():
        raise ValueError(f"{_at(gap, t)} follows a -1: unused slots (-1) must come last")
    _check_owned(batch, s, t)
    srt = s.sort(-1).values
    dup = torch.zeros_like(unused)
    dup[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        l, b, j = (int(i) for i in dup.nonzero()[0])
        raise ValueError(f"token_indices: request {b}{f' (layer {l})' if t.dim() == 3 else ''} "
                         f"lists token {int(srt[l, b, j])} twice")


def _check_owned(batch: DecodeBatch, s: torch.Tensor, t: torch.Tensor) -> None:
    """Every id >= 0 of s [L, B, K] lies in request b's pages at a position < kv_lens[b]."""
    ps, dev = batch.page_size, s.device
    indices, indptr = batch.kv_indices.to(dev).long(), batch.kv_indptr.to(dev).long()
    req = torch.repeat_interleave(torch.arange(batch.batch_size, device=dev), indptr[1:] - indptr[:-1])
    page = s.clamp_min(0) // ps
    span = int(torch.maximum(indices.max(), page.max())) + 1
    keys, order = (req * span + indices).sort()  # one key per (request, page) the batch lists
    b = torch.arange(batch.batch_size, device=dev)[None, :, None]
    want = b * span + page
    i = torch.searchsorted(keys, want).clamp_max(keys.numel() - 1)
    used = s >= 0
    foreign = used & (keys[i] != want)
    if foreign.any():
        raise ValueError(f"{_at(foreign, t)}: its page is not one of the request's pages")
    pos = (order[i] - indptr[b]) * ps + s.clamp_min(0) % ps  # position in the request's context
    late = used & (pos >= batch.kv_lens.to(dev).long()[None, :, None])
    if late.any():
        raise ValueError(f"{_at(late, t)}: past the request's context length")


# -- the object the notebooks use --------------------------------------------------------------
class Indexer:
    """The indexer of every layer for one decode batch: index caches, queries and head weights.

    cfg gives index_n_heads H, index_head_dim D and index_topk; the cache covers every token of
    ``pool`` (any KV page size); queries and weights are random (seeded), drawn per layer:
    q_idx [num_layers, B, H, D] float8_e4m3fn, weights [num_layers, B, H] float32 (q scale folded in).
    """

    def __init__(self, cfg: ModelConfig, pool: KVPool, batch: DecodeBatch, seed: int = 0,
                 index_topk: int | None = None, cache: IndexCache | None = None):
        H, D = cfg.index_n_heads, cfg.index_head_dim
        if H < 1 or D < 1 or cfg.index_topk < 1:
            raise ValueError(f"model {cfg.name!r} has no DSA indexer (index_n_heads={H}, "
                             f"index_head_dim={D}, index_topk={cfg.index_topk})")
        self.cfg, self.pool, self.batch = cfg, pool, batch
        self.index_topk = cfg.index_topk if index_topk is None else index_topk
        self.cache = cache if cache is not None else random_index_cache(pool, D, seed)
        if self.cache.tokens < pool.pool_tokens or self.cache.num_layers != pool.num_layers:
            raise ValueError(f"cache covers {self.cache.num_layers} layers x {self.cache.tokens} tokens; "
                             f"the pool has {pool.num_layers} x {pool.pool_tokens}")
        gen = torch.Generator(device=pool.device).manual_seed(seed + 15485863)
        shape = (pool.num_layers, batch.batch_size, H)
        q = torch.randn(*shape, D, generator=gen, device=pool.device)
        w = torch.randn(*shape, generator=gen, device=pool.device) * (H * D) ** -0.5
        self.q_idx, self.weights = quantize_index_query(q, w)
        self._tables: dict[int, SampleTable] = {}  # sample -> where the candidates' threshold samples

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    def logits(self, layer: int, impl: str = "torch") -> torch.Tensor:
        """[B, max_len] logits of ``layer`` (float64 for "reference", else float32), -inf past lengths."""
        if impl not in LOGITS:
            raise ValueError(f"impl={impl!r}; allowed: {list(LOGITS)}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}; allowed 0..{self.num_layers - 1}")
        return LOGITS[impl](self.q_idx[layer], self.weights[layer], self.cache, layer, self.batch)

    def topk(self, layer: int, impl: str = "torch", check: bool = True, topk_impl: str | None = None) -> torch.Tensor:
        """int32 [B, index_topk] slots of ``layer``: logits by ``impl``, top-k by ``topk_impl``
        (``select_tokens``'; "candidates": ``logits_with_candidates``, with impl "triton")."""
        if topk_impl != "candidates":
            return select_tokens(self.logits(layer, impl), self.batch, self.index_topk, check, topk_impl)
        if impl != "triton":
            raise ValueError(f"topk_impl='candidates' needs impl='triton' (the logits kernel appends them), got {impl!r}")
        logits, cand = self.logits_with_candidates(layer)
        slots = slots_from_candidates(logits, self.batch, self.index_topk, cand)
        if check:
            check_slots(self.batch, slots)
        return slots

    def logits_with_candidates(self, layer: int, sample: int = CAND_SAMPLE) -> tuple[torch.Tensor, tuple]:
        """``logits_with_candidates`` for ``layer``; the sampled positions made once per ``sample``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}; allowed 0..{self.num_layers - 1}")
        return logits_with_candidates(self.q_idx[layer], self.weights[layer], self.cache, layer, self.batch,
                                      self.index_topk, self.sample_table(sample))

    def sample_table(self, sample: int = CAND_SAMPLE) -> SampleTable:
        """This batch's ``sample_table``, made on the first call and kept (make it before a CUDA graph
        capture: made inside one, its tensors would hold data only after a replay)."""
        if sample not in self._tables:
            if self.batch.kv_lens.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("Indexer.sample_table: make it before capturing a graph "
                                   "(call ix.sample_table() once outside the capture)")
            self._tables[sample] = sample_table(self.batch, sample)
        return self._tables[sample]

    def step_slots(self, impl: str = "torch", check: bool = True, topk_impl: str | None = None) -> torch.Tensor:
        """int32 [num_layers, B, index_topk]: one decode step's slots, for DecodeBatch(token_indices=...)."""
        return torch.stack([self.topk(layer, impl, check, topk_impl) for layer in range(self.num_layers)])

    def sparse_batch(self, impl: str = "torch", topk_impl: str | None = None) -> DecodeBatch:
        """The batch with this step's per-layer slots."""
        return self.batch.with_slots(self.step_slots(impl, topk_impl=topk_impl))

    def cost(self) -> dict:
        """Bytes read and FLOPs of one layer's indexer over this batch."""
        n, H, D = self.batch.num_tokens, self.cfg.index_n_heads, self.cfg.index_head_dim
        return {"bytes": index_bytes(n, D), "flops": index_flops(n, H, D)}
