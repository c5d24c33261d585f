"""Model shapes as data and the validated parameters of one lab run.

A bad value raises ``ValueError`` naming the parameter, the value and what is allowed,
before anything is allocated.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .kvlayout import KV_LAYOUTS

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MODELS_DIR = DATA_DIR / "models"

KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}
KV_BYTES = {"fp8_e4m3": 1, "bf16": 2}
MAX_PAGE_SIZE = 128


@dataclass(frozen=True)
class ModelConfig:
    """The attention-relevant fields of a HF config (absorbed MLA)."""

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int  # ckv width: 512 for GLM-5 / DeepSeek
    qk_rope_head_dim: int  # kpe width: 64
    qk_nope_head_dim: int
    v_head_dim: int
    hidden_size: int = 0
    q_lora_rank: int = 0
    index_topk: int = 0  # DSA: token slots each request attends to per layer (0 = dense model)
    index_n_heads: int = 0  # DSA lightning indexer: index heads (32 for GLM-5)
    index_head_dim: int = 0  # ... and values per index head and per index key (128)
    first_k_dense_replace: int = 0
    hf_id: str | None = None

    @property
    def kv_dim(self) -> int:
        """Values per token per layer in the latent cache (512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the un-absorbed head: 1/sqrt(nope + rope) = 1/16 for GLM-5."""
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model(name: str) -> ModelConfig:
    path = MODELS_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"model={name!r} is unknown; allowed: {available_models()}")
    fields = ModelConfig.__dataclass_fields__
    raw = json.loads(path.read_text())
    return ModelConfig(**{k: v for k, v in raw.items() if k in fields})


def parse_context_lens(spec, batch_size: int, seed: int = 0) -> list[int]:
    """Context lengths, one per request, from an int, a list or ``"uniform:LOW:HIGH"``.

    The uniform draw is seeded so that a run is reproducible.
    """
    if isinstance(spec, bool):
        raise ValueError(f"context_lens={spec!r}: expected an int, a list of ints or 'uniform:LOW:HIGH'")
    if isinstance(spec, int):
        lens = [spec] * batch_size
    elif isinstance(spec, (list, tuple)):
        lens = [int(x) for x in spec]
        if len(lens) != batch_size:
            raise ValueError(
                f"context_lens has {len(lens)} entries but batch_size={batch_size}; "
                "give one length per request or a single int"
            )
    elif isinstance(spec, str) and spec.startswith("uniform:"):
        try:
            _, lo, hi = spec.split(":")
            lo, hi = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"context_lens={spec!r}: expected 'uniform:LOW:HIGH' with integers") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"context_lens={spec!r}: need 1 <= LOW <= HIGH")
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(lo, hi + 1, (batch_size,), generator=g).tolist()
    elif isinstance(spec, str) and spec.strip().lstrip("-").isdigit():
        return parse_context_lens(int(spec), batch_size, seed)
    else:
        raise ValueError(f"context_lens={spec!r}: expected an int, a list of ints or 'uniform:LOW:HIGH'")
    bad = [x for x in lens if x < 1]
    if bad:
        raise ValueError(f"context_lens={spec!r}: every length must be >= 1, got {bad[:4]}")
    return lens


def _device_memory_bytes(device: str) -> int | None:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    if device == "cpu":
        try:
            import os

            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device.startswith("cuda"):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; allowed: 'cpu' or 'auto'")
        return device
    raise ValueError(f"device={device!r}; allowed: 'auto', 'cpu', 'cuda', 'cuda:N'")


@dataclass
class LabParams:
    """Everything one lab run is parameterised by. Call ``validate()`` (done by ``make``)."""

    model: str = "tiny"
    num_layers: int | None = None  # layers used; None = all of the model's
    tp_size: int = 1  # heads per GPU = num_attention_heads / tp_size
    pool_tokens: int = 16384  # KV pool size per layer, in tokens
    page_size: int = 64
    batch_size: int = 4
    context_lens: object = 1024  # int, list or "uniform:LOW:HIGH"
    kv_dtype: str = "fp8_e4m3"
    kv_layout: str | None = None  # labkit.kvlayout name; None: the one kv_dtype means (set by validate)
    device: str = "auto"
    seed: int = 0
    cfg: ModelConfig = field(init=False, repr=False, default=None)
    lens: list = field(init=False, repr=False, default=None)

    @classmethod
    def make(cls, **kw) -> "LabParams":
        allowed = [f for f in cls.__dataclass_fields__ if f not in ("cfg", "lens")]
        unknown = sorted(set(kw) - set(allowed))
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}; allowed: {allowed}")
        p = cls(**kw)
        p.validate()
        return p

    # -- derived -------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp_size

    @property
    def layers(self) -> int:
        return self.num_layers if self.num_layers is not None else self.cfg.num_hidden_layers

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token's row per layer: 576 x bytes per value, 656 for fp8_ds_mla."""
        if self.kv_layout == "fp8_ds_mla":  # e4m3 NoPE, an fp32 scale per 128 of it, bf16 RoPE
            return self.cfg.kv_lora_rank + 4 * (self.cfg.kv_lora_rank // 128) + 2 * self.cfg.qk_rope_head_dim
        return self.cfg.kv_dim * KV_BYTES[self.kv_dtype]

    @property
    def pool_bytes(self) -> int:
        """Bytes of KV held on the device: layers x pool tokens x bytes per token."""
        return self.layers * self.num_pages * self.page_size * self.bytes_per_token

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("cfg", "lens")}
        d["heads"] = self.heads
        d["layers"] = self.layers
        return d

    # -- validation ----------------------------------------------------------------
    def validate(self) -> "LabParams":
        self.cfg = load_model(self.model)
        for name in ("tp_size", "pool_tokens", "page_size", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if self.num_layers is not None:
            if not isinstance(self.num_layers, int) or not 1 <= self.num_layers <= self.cfg.num_hidden_layers:
                raise ValueError(
                    f"num_layers={self.num_layers!r}: allowed 1..{self.cfg.num_hidden_layers} "
                    f"for model {self.model!r}, or None for all"
                )
        ps = self.page_size
        if ps & (ps - 1) or ps > MAX_PAGE_SIZE:
            raise ValueError(f"page_size={ps}: must be a power of two from 1 to {MAX_PAGE_SIZE}")
        if self.cfg.num_attention_heads % self.tp_size:
            divisors = [d for d in range(1, self.cfg.num_attention_heads + 1) if self.cfg.num_attention_heads % d == 0]
            raise ValueError(
                f"tp_size={self.tp_size} does not divide num_attention_heads={self.cfg.num_attention_heads} "
                f"of model {self.model!r}; allowed: {divisors}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}; allowed: {sorted(KV_DTYPES)}")
        self._check_layout()
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be an integer")
        if self.pool_tokens % ps:
            raise ValueError(f"pool_tokens={self.pool_tokens} is not a multiple of page_size={ps}")
        self.device = resolve_device(self.device)
        self.lens = parse_context_lens(self.context_lens, self.batch_size, self.seed)
        pages_needed = sum(-(-n // ps) for n in self.lens)
        if pages_needed > self.num_pages:
            raise ValueError(
                f"context_lens need {pages_needed} pages of {ps} tokens ({sum(self.lens)} tokens) but "
                f"pool_tokens={self.pool_tokens} holds {self.num_pages} pages; raise pool_tokens or shorten contexts"
            )
        self._check_memory()
        return self

    def _check_layout(self) -> None:
        """kv_layout among KV_LAYOUTS and stored in kv_dtype; None becomes kv_dtype's own layout."""
        if self.kv_layout is None:
            self.kv_layout = "bf16" if self.kv_dtype == "bf16" else "fp8_per_tensor"
        if not isinstance(self.kv_layout, str) or self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}; allowed: {list(KV_LAYOUTS)} or None")
        if (self.kv_layout == "bf16") != (self.kv_dtype == "bf16"):
            fits = ["bf16"] if self.kv_dtype == "bf16" else [k for k in KV_LAYOUTS if k != "bf16"]
            raise ValueError(f"kv_layout={self.kv_layout!r} does not store kv_dtype={self.kv_dtype!r}; "
                             f"with kv_dtype={self.kv_dtype!r} allowed kv_layout: {fits}")

    def _check_memory(self) -> None:
        total = _device_memory_bytes(self.device)
        if total is None:
            return
        # the pool, plus the largest working copy any path makes: one layer in BF16
        need = self.pool_bytes + self.pool_tokens * self.cfg.kv_dim * 2
        row = (f"{self.bytes_per_token} B ({self.kv_layout} rows)" if self.kv_layout == "fp8_ds_mla"
               else f"{self.cfg.kv_dim} values x {KV_BYTES[self.kv_dtype]} B")
        if need > 0.9 * total:
            raise ValueError(
                f"pool_tokens={self.pool_tokens}: {self.layers} layers x {self.pool_tokens} tokens x "
                f"{row} = {self.pool_bytes / 2**30:.2f} GiB, "
                f"plus one BF16 layer copy ({self.pool_tokens * self.cfg.kv_dim * 2 / 2**30:.2f} GiB) = "
                f"{need / 2**30:.2f} GiB > 90% of {self.device} memory ({total / 2**30:.2f} GiB)"
            )

