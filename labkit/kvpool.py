"""A paged MLA KV pool per layer and decode batches described the FlashInfer way.

Layout (SGLang/FlashInfer MLA): every token of every layer holds one latent row of
``kv_dim = kv_lora_rank + qk_rope_head_dim`` values (512 ``ckv`` + 64 ``kpe`` = 576), shared
by all heads. Rows are grouped into pages of ``page_size`` tokens:

    kv_buffer: [num_layers, num_pages, page_size, kv_dim]  float8_e4m3fn or bfloat16
    k_scale:   [num_layers] float32, per-tensor, real = stored * k_scale (1.0 for BF16)

The same latent row is both key (all 576) and value (the first 512), so ``v_scale == k_scale``.
A batch reads pages through ``kv_indptr`` / ``kv_indices`` (page ids) / ``kv_last_page_len``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import KV_DTYPES

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass
class KVPool:
    kv_buffer: torch.Tensor  # [num_layers, num_pages, page_size, kv_dim]
    k_scale: torch.Tensor  # [num_layers] float32, kept on the CPU: kernels take it as a scalar
    kv_lora_rank: int = 512

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
        return self.kv_buffer.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_buffer.dtype

    @property
    def kv_dtype(self) -> str:
        return next(k for k, v in KV_DTYPES.items() if v == self.dtype)

    @property
    def device(self) -> torch.device:
        return self.kv_buffer.device

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, i: int) -> torch.Tensor:
        """[num_pages, page_size, kv_dim] in storage dtype (a view)."""
        return self.kv_buffer[i]

    def scale(self, i: int) -> float:
        return float(self.k_scale[i])

    def ckv(self, i: int) -> torch.Tensor:
        return self.kv_buffer[i, ..., : self.kv_lora_rank]

    def kpe(self, i: int) -> torch.Tensor:
        return self.kv_buffer[i, ..., self.kv_lora_rank :]

    def dequant(self, i: int, dtype=torch.float32) -> torch.Tensor:
        """Real values of layer ``i``: [num_pages, page_size, kv_dim] in ``dtype``."""
        return self.kv_buffer[i].to(dtype) * self.scale(i)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-tensor FP8 e4m3 quantization with torch: returns (x_fp8, k_scale), x ~= x_fp8 * k_scale."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    k_scale = float(amax) / E4M3_MAX
    q = (x.float() / k_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, k_scale


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
):
    """A pool of ``pool_tokens // page_size`` pages per layer filled with random real data.

    With ``return_source`` also returns the unquantized float32 data
    [num_layers, num_pages, page_size, kv_dim] (keep pools small then).
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; allowed: {sorted(KV_DTYPES)}")
    num_pages = pool_tokens // page_size
    kv_dim = kv_lora_rank + qk_rope_head_dim
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    buf = torch.empty(num_layers, num_pages, page_size, kv_dim, dtype=KV_DTYPES[kv_dtype], device=device)
    scales = torch.ones(num_layers, dtype=torch.float32)
    source = torch.empty(buf.shape, dtype=torch.float32) if return_source else None
    for i in range(num_layers):
        x = _draw_layer(buf.shape[1:], gen, device, std=0.5 + 0.25 * (i % 4))
        if kv_dtype == "fp8_e4m3":
            buf[i], scales[i] = quantize_e4m3(x)
        else:
            buf[i] = x.to(buf.dtype)
        if source is not None:
            source[i] = x.cpu()
        del x
    pool = KVPool(buf, scales, kv_lora_rank)
    return (pool, source.to(device)) if return_source else pool


@dataclass
class DecodeBatch:
    """Which pages each request reads. ``B`` requests, ``nnz`` pages in all.

    kv_indptr:        [B + 1] int32, request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices:       [nnz] int32 page ids into the pool
    kv_last_page_len: [B] int32, tokens used in each request's last page (1..page_size)
    kv_lens:          [B] int32, context length of each request
    token_indices:    reserved for sparse (DSA top-k) decode: [B, topk] int32 token ids, or None
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
        """L: tokens the batch reads (per layer)."""
        return sum(self.lens_host)

    @property
    def num_pages(self) -> int:
        return self.kv_indices.numel()

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


def make_queries(batch_size: int, num_heads: int, kv_lora_rank=512, qk_rope_head_dim=64,
                 dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """q_nope [B, H, kv_lora_rank] and q_pe [B, H, qk_rope_head_dim], unit Gaussian."""
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    q = torch.randn(batch_size, num_heads, kv_lora_rank + qk_rope_head_dim, generator=gen, device=device)
    q = q.to(dtype)
    return q[..., :kv_lora_rank].contiguous(), q[..., kv_lora_rank:].contiguous()
