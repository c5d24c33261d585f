"""One decode batch on a pool, the backend for a path, records: what every experiment starts from.

    lab = Lab.build(LabParams.make(model="glm5", tp_size=4, ...), run_dir, warmup_ms=25, rep_ms=100)
    b = pick("fp8_native", "auto", lab.device, "fast", lab)   # backends.select for this batch
    lab.save(rows, "03_paths")             # records into the run folder (labkit.results)

Timing, sweeps and profiles of a lab are in labkit.measure; tables of records in labkit.tables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from . import backends, config, reference, results
from .config import DATA_DIR, KV_BYTES, LabParams
from .kvpool import DecodeBatch, KVPool, batch_for_pool, make_queries, random_pool
from .memory import predicted_extra_bytes

INTERACTIVE_RUN = DATA_DIR / "runs" / "interactive"  # where notebooks run by hand record
MAIN_PATHS = ("full_pool_cast", "gather_cast", "fp8_native")
TIMING_KEYS = ("path", "backend", "impl", "median_ms", "p20_ms", "p80_ms")


def run_folder(run_dir=None) -> Path:
    """``run_dir``, else ``$LABKIT_RUN_DIR``, else data/runs/interactive; created if missing."""
    path = Path(run_dir or os.environ.get("LABKIT_RUN_DIR") or INTERACTIVE_RUN)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Lab:
    """A decode batch on a pool, on a device, with the run's timing settings."""

    p: LabParams
    pool: KVPool
    batch: DecodeBatch
    q_nope: torch.Tensor  # [B, H, 512] bf16
    q_pe: torch.Tensor  # [B, H, 64] bf16
    run_dir: Path
    warmup_ms: float = 25
    rep_ms: float = 100

    @classmethod
    def build(cls, p: LabParams, run_dir=None, warmup_ms: float = 25, rep_ms: float = 100) -> "Lab":
        """Allocate the pool, the batch and the queries. On a CPU torch is set to one thread: with
        more, a core taken by another process stalls every op (times jump 10-100x)."""
        if p.device == "cpu":
            torch.set_num_threads(1)
        c = p.cfg
        pool = random_pool(p.layers, p.pool_tokens, p.page_size, p.kv_dtype, c.kv_lora_rank,
                           c.qk_rope_head_dim, device=p.device, seed=p.seed, kv_layout=p.kv_layout)
        q_nope, q_pe = make_queries(p.batch_size, p.heads, c.kv_lora_rank, c.qk_rope_head_dim,
                                    device=p.device, seed=p.seed)
        return cls(p, pool, batch_for_pool(pool, p.lens, p.seed), q_nope, q_pe, run_folder(run_dir),
                   warmup_ms, rep_ms)

    @property
    def device(self) -> str:
        return self.p.device

    @property
    def sm_scale(self) -> float:
        return self.p.cfg.sm_scale

    def shape(self) -> dict:
        return dict(pool_tokens=self.pool.pool_tokens, batch_size=self.batch.batch_size,
                    heads=self.q_nope.shape[1], tokens_read=self.batch.tokens_read,
                    context_len=self.batch.max_len, kv_dtype=self.pool.kv_dtype, kv_layout=self.pool.kv_layout,
                    topk=self.batch.topk)

    def summary(self) -> str:
        s, p = self.shape(), self.p
        return (f"{p.model}: {self.pool.num_layers} layers x {s['pool_tokens']:,}-token pool ({self.pool.num_pages:,} pages "
                f"of {p.page_size}, {s['kv_dtype']}), batch {s['batch_size']} x up to {s['context_len']:,} tokens = "
                f"{s['tokens_read'] / s['pool_tokens']:.1%} of the pool, {s['heads']} heads per GPU, on {self.device}")

    def case(self, pool_tokens: int | None = None, lens=None, heads: int | None = None) -> "Lab":
        """The same lab with a one-layer pool of ``pool_tokens``, other context lengths or heads."""
        c, p = self.p.cfg, self.p
        pool = self.pool
        if pool_tokens is not None:
            pool = random_pool(1, pool_tokens, p.page_size, p.kv_dtype, c.kv_lora_rank, c.qk_rope_head_dim,
                               device=p.device, seed=p.seed, kv_layout=self.pool.kv_layout)
        lens = list(lens) if lens is not None else p.lens
        batch = self.batch if pool is self.pool and lens == p.lens else batch_for_pool(pool, lens, p.seed)
        heads = heads or self.q_nope.shape[1]
        q_nope, q_pe = self.q_nope, self.q_pe
        if (batch.batch_size, heads) != tuple(q_nope.shape[:2]):
            q_nope, q_pe = make_queries(batch.batch_size, heads, c.kv_lora_rank, c.qk_rope_head_dim,
                                        device=p.device, seed=p.seed)
        return replace(self, pool=pool, batch=batch, q_nope=q_nope, q_pe=q_pe)

    def bf16(self) -> "Lab":
        """Layer 0 of the pool as a BF16 pool of the same real values: what ``bf16_pool`` reads."""
        pool = KVPool(self.pool.dequant(0, torch.bfloat16)[None], torch.ones(1), self.pool.kv_lora_rank)
        return replace(self, pool=pool)

    def decode(self, backend, layer: int = 0):
        return backend.decode(self.q_nope, self.q_pe, self.pool, layer, self.batch, self.sm_scale)

    def save(self, rows, name: str) -> Path:
        return save(rows, self.run_dir, name, self.p)


def pick(path: str, impl: str = "auto", device: str = "cpu", precision: str = "fast",
         lab: "Lab | None" = None) -> backends.Backend:
    """The backend for ``path``. ``auto``: ``backends.select`` for this call (the lab's batch, heads and
    pool, the BF16 copy for ``bf16_pool``; without a lab a one-request probe on ``device``): the fastest
    implementation measured here whose rules allow it at ``precision``. Another name picks that
    implementation where the path has it, else ``auto``."""
    if impl != "auto":
        if f"{path}.{impl}" in backends.names(path):
            return backends.get(f"{path}.{impl}")
        known = sorted({r["impl"] for r in backends.capability_table()})
        if impl not in known:
            raise ValueError(f"impl={impl!r}; allowed: {['auto'] + known}")
    on = _probe(path, device) if lab is None else (lab.bf16() if path == "bf16_pool" and lab.pool.kv_dtype != "bf16"
                                                   else lab)
    return backends.select(path, on.q_nope, on.pool, on.batch, precision)


def _probe(path: str, device: str):
    """A one-layer, one-request call for ``select`` when there is no lab: 16 heads, pages of 64."""
    from types import SimpleNamespace

    pool = random_pool(1, 128, 64, "bf16" if path == "bf16_pool" else "fp8_e4m3", device=device)
    q_nope, _ = make_queries(1, 16, device=device)
    return SimpleNamespace(q_nope=q_nope, pool=pool, batch=batch_for_pool(pool, [100]))


def _on(lab: Lab, backend) -> Lab:
    """The lab a backend reads: ``bf16_pool`` backends get the BF16 copy of the pool."""
    return lab.bf16() if backend.path == "bf16_pool" and lab.pool.kv_dtype != "bf16" else lab


def oracle(lab: Lab, layer: int = 0) -> torch.Tensor:
    """float64 absorbed MLA over the dequantized layer: [B, H, 512]."""
    kv = lab.pool.dequant(layer, torch.float64)
    return reference.mla_decode(lab.q_nope, lab.q_pe, kv, lab.batch, lab.sm_scale)


def save(rows, run_dir, name: str, p: LabParams | None = None) -> Path:
    """Write rows (a DataFrame or dicts, timing keys optional) as records ``<run_dir>/<name>.parquet``,
    replacing an earlier file of that name; with ``p`` each record carries the run's parameters
    and the device's environment."""
    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    env = results.env_info(p.device) if p is not None else {}
    recs = []
    for r in rows:
        timing = [r.get(k, "" if k in TIMING_KEYS[:3] else float("nan")) for k in TIMING_KEYS]
        extra = {k: v for k, v in r.items() if k not in TIMING_KEYS}
        params = {k: v for k, v in p.as_dict().items() if k not in extra} if p is not None else {}
        recs.append(results.make_record(*timing, params=params, device_env=env, **extra))
    (Path(run_dir) / f"{name}.parquet").unlink(missing_ok=True)
    return results.write_records(run_dir, recs, name)


def records_of(df: pd.DataFrame, experiment: str) -> pd.DataFrame:
    """The records of one experiment (empty if there are none)."""
    return df[df.experiment == experiment] if "experiment" in df else df.iloc[:0]


# -- the setup: shape and memory as configured ------------------------------------------------------
def describe(p: LabParams) -> pd.DataFrame:
    """The model shape, the pool and the batch as configured: (quantity, value)."""
    c, kv_bytes = p.cfg, KV_BYTES[p.kv_dtype]
    read = sum(p.lens)
    rows = [("model", c.hf_id or c.name), ("layers (of the model)", f"{p.layers} ({c.num_hidden_layers})"),
            ("heads per GPU", f"{p.heads} = {c.num_attention_heads} / tp {p.tp_size}"),
            ("KV row per token per layer", f"{c.kv_dim} = ckv {c.kv_lora_rank} + kpe {c.qk_rope_head_dim} values"),
            ("KV dtype", f"{p.kv_dtype} ({kv_bytes} B per value)"), ("sm_scale", f"{c.sm_scale:.4g}"),
            ("pool tokens per layer", f"{p.pool_tokens:,} = {p.num_pages:,} pages x {p.page_size}"),
            ("pool per layer", f"{p.pool_tokens * c.kv_dim * kv_bytes / 2**20:,.1f} MiB"),
            ("pool, all layers", f"{p.pool_bytes / 2**30:,.2f} GiB"),
            ("batch", f"{p.batch_size} requests, contexts {min(p.lens):,}..{max(p.lens):,} tokens"),
            ("tokens read per layer (L)", f"{read:,} = {read / p.pool_tokens:.1%} of the pool")]
    return pd.DataFrame(rows, columns=["quantity", "value"])


def memory_table(p: LabParams) -> pd.DataFrame:
    """Bytes each path allocates per layer beyond the pool (labkit.memory), beside the pool itself."""
    total = config._device_memory_bytes(p.device) or float("nan")
    read = sum(-(-n // p.page_size) for n in p.lens) * p.page_size  # a gather copies whole pages
    rows = []
    for path in MAIN_PATHS:
        extra = predicted_extra_bytes(path, p.pool_tokens, read, p.batch_size, p.heads, p.kv_dtype)
        rows.append(dict(path=path, predicted_extra_bytes=extra, extra_mib=extra / 2**20,
                         pool_gib=p.pool_bytes / 2**30, share_of_device=(p.pool_bytes + extra) / total))
    return pd.DataFrame(rows)
