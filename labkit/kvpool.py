"""A paged MLA KV pool per layer and decode batches described the FlashInfer way.

Layout (SGLang/FlashInfer MLA): every token of every layer holds one latent row of
``kv_dim = kv_lora_rank + qk_rope_head_dim`` values (512 ``ckv`` + 64 ``kpe`` = 576), shared
by all heads. Rows are grouped into pages of ``page_size`` tokens:

    kv_buffer: [num_layers, num_pages, page_size, row]   row per ``kv_layout`` (labkit.kvlayout):
               "fp8_per_tensor"  float8_e4m3fn [576]
               "fp8_ds_mla"      uint8 [656]: 512 e4m3 | 4 fp32 group scales | 64 bf16
               "bf16"            bfloat16 [576]
    k_scale:   [num_layers] float32, per-tensor, real = stored * k_scale (1.0 for BF16 and ds_mla)

The same latent row is both key (all 576) and value (the first 512), so ``v_scale == k_scale``.
Token ``t`` of the pool is row ``t`` of ``rows(layer)``: page ``t // page_size``, slot ``t % page_size``.
A dense batch reads pages through ``kv_indptr`` / ``kv_indices`` (page ids) / ``kv_last_page_len``;
a sparse (DSA) batch also carries per request its top-k token ids (``token_indices``, -1 = none).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import kvlayout
from .config import KV_DTYPES
from .kvlayout import E4M3_MAX, quantize_e4m3  # noqa: F401


@dataclass
class KVPool:
    kv_buffer: torch.Tensor  # [num_layers, num_pages, page_size, kv_dim]
    k_scale: torch.Tensor  # [num_layers] float32, kept on the CPU: kernels take it as a scalar
    kv_lora_rank: int = 512
    kv_layout: str | None = None  # None: from the buffer's dtype ("bf16" or "fp8_per_tensor")

    def __post_init__(self):
        if self.kv_layout is None:
            self.kv_layout = "bf16" if self.kv_buffer.dtype == torch.bfloat16 else "fp8_per_tensor"
        kvlayout.check_layout(self.kv_layout)
        want = {"bf16": torch.bfloat16, "fp8_per_tensor": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}
        if self.kv_buffer.dtype != want[self.kv_layout]:
            raise ValueError(f"kv_layout={self.kv_layout!r} stores {want[self.kv_layout]}, "
                             f"the buffer holds {self.kv_buffer.dtype}")

    @property
    def num_layers(self) -> int:
        return self.kv_buffer.shape[0]

    @property
    def num_pages(self) -> int:
        return self.kv_buffer.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv_buffer.shape[2]

    @property
    def kv_dim(self) -> int:
        """Values per token (576), whatever the layout stores."""
        return self.kv_lora_rank + 64 if self.kv_layout == "fp8_ds_mla" else self.kv_buffer.shape[3]

    @property
    def bytes_per_token(self) -> int:
        return kvlayout.KV_LAYOUTS[self.kv_layout]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_buffer.dtype

    @property
    def kv_dtype(self) -> str:
        """"fp8_e4m3" for both FP8 layouts, "bf16" otherwise."""
        return "bf16" if self.kv_layout == "bf16" else "fp8_e4m3"

    @property
    def device(self) -> torch.device:
        return self.kv_buffer.device

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, i: int) -> torch.Tensor:
        """[num_pages, page_size, kv_dim] in storage dtype (a view)."""
        return self.kv_buffer[i]

    def rows(self, i: int) -> torch.Tensor:
        """[pool_tokens, row] in storage dtype (a view): row t is token t, the id sparse batches use."""
        return self.kv_buffer[i].flatten(0, 1)

    def scale(self, i: int) -> float:
        """The per-tensor scale of layer ``i``; ``fp8_ds_mla`` rows carry their own scales."""
        if self.kv_layout == "fp8_ds_mla":
            raise ValueError("kv_layout='fp8_ds_mla' has a scale per 128 values in each row, no per-tensor "
                             "k_scale; read the rows with labkit.kvlayout (ds_scales) or use dequant()")
        return float(self.k_scale[i])

    def ckv(self, i: int) -> torch.Tensor:
        return self.kv_buffer[i, ..., : self.kv_lora_rank]

    def kpe(self, i: int) -> torch.Tensor:
        return self.kv_buffer[i, ..., self.kv_lora_rank :]

    def dequant(self, i: int, dtype=torch.float32) -> torch.Tensor:
        """Real values of layer ``i``: [num_pages, page_size, 576] in ``dtype``, any layout."""
        k_scale = 1.0 if self.kv_layout == "fp8_ds_mla" else self.scale(i)
        return kvlayout.dequant(self.kv_buffer[i], self.kv_layout, k_scale, dtype)


def _draw_layer(shape, gen, device, std) -> torch.Tensor:
    """Real-valued latent rows: Gaussian with a few outliers, so the scale is far from 1 and matters."""
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
    spikes = torch.rand(shape, generator=gen, device=device) < 1e-3
    return torch.where(spikes, x * 4, x)


def random_pool(
    num_layers: int,
    pool_tokens: int,
    page_size: int,
    kv_dtype: str = "fp8_e4m3",
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    device="cpu",
    seed: int = 0,
    return_source: bool = False,
    kv_layout: str | None = None,
):
    """A pool of ``pool_tokens // page_size`` pages per layer filled with random real data.

    ``kv_layout`` (labkit.kvlayout) overrides ``kv_dtype``: "fp8_e4m3" means "fp8_per_tensor".
    With ``return_source`` also returns the unquantized float32 data
    [num_layers, num_pages, page_size, 576] (keep pools small then).
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; allowed: {sorted(KV_DTYPES)}")
    layout = kvlayout.check_layout(kv_layout or ("bf16" if kv_dtype == "bf16" else "fp8_per_tensor"))
    num_pages = pool_tokens // page_size
    kv_dim = kv_lora_rank + qk_rope_head_dim
    row = kvlayout.KV_LAYOUTS[layout] if layout == "fp8_ds_mla" else kv_dim
    dtype = {"bf16": torch.bfloat16, "fp8_per_tensor": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}[layout]
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    buf = torch.empty(num_layers, num_pages, page_size, row, dtype=dtype, device=device)
    scales = torch.ones(num_layers, dtype=torch.float32)
    source = torch.empty(num_layers, num_pages, page_size, kv_dim, dtype=torch.float32) if return_source else None
    for i in range(num_layers):
        x = _draw_layer((num_pages, page_size, kv_dim), gen, device, std=0.5 + 0.25 * (i % 4))
        buf[i], scales[i] = kvlayout.quantize(x, layout)
        if source is not None:
            source[i] = x.cpu()
        del x
    pool = KVPool(buf, scales, kv_lora_rank, layout)
    return (pool, source.to(device)) if return_source else pool


@dataclass
class DecodeBatch:
    """Which pages each request reads. ``B`` requests, ``nnz`` pages in all.

    kv_indptr:        [B + 1] int32, request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices:       [nnz] int32 page ids into the pool
    kv_last_page_len: [B] int32, tokens used in each request's last page (1..page_size)
    kv_lens:          [B] int32, context length of each request
    token_indices:    sparse (DSA) decode: the top-k token ids each request attends to, global rows
                      of ``KVPool.rows`` (page_id * page_size + slot), -1 = none (never read); int32
                      [B, topk] (the same slots in every layer) or [num_layers, B, topk] (per layer,
                      as an indexer gives them); None: dense, every token of the request's pages
    lens_host:        the context lengths as a host tuple, so that launchers never read them back
                      from the device (a sync per call, which would stall a decode step)
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int
    token_indices: torch.Tensor | None = None
    lens_host: tuple | None = None

    def __post_init__(self):
        if self.lens_host is None:
            self.lens_host = tuple(int(n) for n in self.kv_lens.tolist())

    @property
    def batch_size(self) -> int:
        return self.kv_lens.numel()

    @property
    def num_tokens(self) -> int:
        """Tokens in the requests' contexts (per layer); what a dense batch reads."""
        return sum(self.lens_host)

    @property
    def tokens_read(self) -> int:
        """L: tokens attention reads per layer: the contexts when dense; for a sparse batch the valid
        slots, topk per request or the whole context when shorter (from the host lengths: no sync)."""
        k = self.topk
        return sum(min(n, k) for n in self.lens_host) if k else sum(self.lens_host)

    @property
    def num_pages(self) -> int:
        return self.kv_indices.numel()

    @property
    def topk(self) -> int:
        """Slots per request of a sparse batch; 0 for a dense one."""
        return 0 if self.token_indices is None else self.token_indices.shape[-1]

    def slots(self, layer: int = 0) -> torch.Tensor | None:
        """[B, topk] int32 token ids of ``layer`` (None when dense)."""
        t = self.token_indices
        return t if t is None or t.dim() == 2 else t[layer]

    def with_slots(self, token_indices: torch.Tensor | None) -> "DecodeBatch":
        """The same planned batch with one layer's slots [B, topk] (no copy, no validation)."""
        return replace(self, token_indices=token_indices)

    @property
    def max_len(self) -> int:
        return max(self.lens_host)

    def to(self, device) -> "DecodeBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            kv_indptr=move(self.kv_indptr),
            kv_indices=move(self.kv_indices),
            kv_last_page_len=move(self.kv_last_page_len),
            kv_lens=move(self.kv_lens),
            token_indices=move(self.token_indices),
        )

    def compact(self) -> "DecodeBatch":
        """The same batch over a gathered buffer whose page j is this batch's kv_indices[j]."""
        idx = torch.arange(self.num_pages, dtype=torch.int32, device=self.kv_indices.device)
        return replace(self, kv_indices=idx)

    def pages_of(self, b: int) -> torch.Tensor:
        return self.kv_indices[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])]


def make_batch(num_pages: int, page_size: int, context_lens, seed: int = 0, device="cpu") -> DecodeBatch:
    """A batch of requests with the given context lengths, pages scattered at random over the pool."""
    lens = [int(n) for n in context_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"context_lens={lens[:8]}: need at least one request, every length >= 1")
    pages = [-(-n // page_size) for n in lens]
    if sum(pages) > num_pages:
        raise ValueError(
            f"context_lens need {sum(pages)} pages of {page_size} tokens; the pool has {num_pages}"
        )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages), 0)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    last = kv_lens - (torch.tensor(pages, dtype=torch.int32) - 1) * page_size
    return DecodeBatch(indptr, ids, last, kv_lens, page_size).to(device)


def batch_for_pool(pool: KVPool, context_lens, seed: int = 0) -> DecodeBatch:
    return make_batch(pool.num_pages, pool.page_size, context_lens, seed, pool.device)


def _context_tokens(pages: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Global token ids [n] int64 of a context of ``n`` tokens on ``pages`` (its page ids, host)."""
    pages = pages[: -(-n // page_size)].long()
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]


def random_slots(batch: DecodeBatch, topk: int, seed: int = 0, num_layers: int | None = None) -> torch.Tensor:
    """Random top-k token slots, the shape an indexer gives: int32 [B, topk], or
    [num_layers, B, topk] when ``num_layers`` is given (an independent draw per layer).

    Each request gets ``topk`` distinct token ids drawn from its own context (global rows of
    ``KVPool.rows``: page_id * page_size + slot), unsorted; a context shorter than ``topk`` gives all
    its tokens (shuffled) and then -1 padding at the end. On the batch's device.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r}: must be a positive integer")
    if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"num_layers={num_layers!r}: must be a positive integer or None")
    gen = torch.Generator().manual_seed(seed)
    indices, start = batch.kv_indices.cpu(), batch.kv_indptr.tolist()
    ctx = [_context_tokens(indices[start[b]:], n, batch.page_size) for b, n in enumerate(batch.lens_host)]
    out = torch.full((num_layers or 1, batch.batch_size, topk), -1, dtype=torch.int32)
    for layer in range(out.shape[0]):
        for b, toks in enumerate(ctx):
            pick = torch.randperm(toks.numel(), generator=gen)[:topk]
            out[layer, b, : pick.numel()] = toks[pick].to(torch.int32)
    out = out.to(batch.kv_indices.device)
    return out if num_layers is not None else out[0]


def make_sparse_batch(num_pages: int, page_size: int, context_lens, topk: int, seed: int = 0, device="cpu",
                      num_layers: int | None = None) -> DecodeBatch:
    """``make_batch`` plus random top-k slots (``random_slots``): [B, topk], or per layer
    [num_layers, B, topk] when ``num_layers`` is given."""
    batch = make_batch(num_pages, page_size, context_lens, seed, device)
    return batch.with_slots(random_slots(batch, topk, seed + 1, num_layers))


def sparse_batch_for_pool(pool: KVPool, context_lens, topk: int, seed: int = 0, per_layer: bool = False) -> DecodeBatch:
    """A sparse batch on ``pool``: the same slots in every layer, or with ``per_layer`` one draw per layer."""
    return make_sparse_batch(pool.num_pages, pool.page_size, context_lens, topk, seed, pool.device,
                             pool.num_layers if per_layer else None)


def make_queries(batch_size: int, num_heads: int, kv_lora_rank=512, qk_rope_head_dim=64,
                 dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """q_nope [B, H, kv_lora_rank] and q_pe [B, H, qk_rope_head_dim], unit Gaussian."""
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    q = torch.randn(batch_size, num_heads, kv_lora_rank + qk_rope_head_dim, generator=gen, device=device)
    q = q.to(dtype)
    return q[..., :kv_lora_rank].contiguous(), q[..., kv_lora_rank:].contiguous()
