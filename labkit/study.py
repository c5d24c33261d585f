"""The experiments the notebooks share: one decode batch on a pool, paths side by side, sweeps.

    lab = Lab.build(LabParams.make(model="glm5", tp_size=4, ...), run_dir, warmup_ms=25, rep_ms=100)
    rows = side_by_side(lab, ["full_pool_cast", "gather_cast", "fp8_native"], impl="auto", ceilings=c)
    save(lab, rows, "03_paths")            # records into the run folder (labkit.results)

Times are of ONE layer (layer 0) unless a column says otherwise; a decode step is ``layers`` of
them plus the rest of the model (labkit.stepmodel). Every row names its shape: pool_tokens,
batch_size, heads, tokens_read (L), context_len (the longest request).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from . import backends, reference
from .config import DATA_DIR, LabParams
from .kvpool import DecodeBatch, KVPool, batch_for_pool, make_queries, random_pool

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
        c = p.cfg
        pool = random_pool(p.layers, p.pool_tokens, p.page_size, p.kv_dtype, c.kv_lora_rank,
                           c.qk_rope_head_dim, device=p.device, seed=p.seed)
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
                    heads=self.q_nope.shape[1], tokens_read=self.batch.num_tokens,
                    context_len=self.batch.max_len, kv_dtype=self.pool.kv_dtype)

    def case(self, pool_tokens: int | None = None, lens=None, heads: int | None = None) -> "Lab":
        """The same lab with a one-layer pool of ``pool_tokens``, other context lengths or heads."""
        c, p = self.p.cfg, self.p
        pool = self.pool
        if pool_tokens is not None:
            pool = random_pool(1, pool_tokens, p.page_size, p.kv_dtype, c.kv_lora_rank, c.qk_rope_head_dim,
                               device=p.device, seed=p.seed + 1)
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


def pick(path: str, impl: str = "auto", device: str = "cpu") -> backends.Backend:
    """The backend for ``path``. ``auto``: torch on a CPU; on a GPU the seed's cast for
    full_pool_cast, Triton elsewhere (torch when no Triton backend is registered)."""
    cuda = str(device).startswith("cuda")
    if impl == "auto":
        impl = ("seed" if path == "full_pool_cast" else "triton") if cuda else "torch"
    names = backends.names(path)
    for cand in (impl, "triton", "torch") if impl == "seed" else (impl,):
        if f"{path}.{cand}" in names:
            return backends.get(f"{path}.{cand}")
    return backends.get(f"{path}.{impl}")  # raises, naming what is allowed


def _on(lab: Lab, backend) -> Lab:
    """The lab a backend reads: ``bf16_pool`` backends get the BF16 copy of the pool."""
    return lab.bf16() if backend.path == "bf16_pool" and lab.pool.kv_dtype != "bf16" else lab


def time_backend(lab: Lab, backend, ceilings=None, **extra) -> dict:
    """One row: the backend's median/p20/p80 for one layer, the shape, ``extra``; with ``ceilings``
    also bytes, GB/s, TFLOP/s and % of roofline (labkit.roofline.achieved)."""
    from .roofline import achieved
    from .timing import bench

    lab = _on(lab, backend)
    t = bench(lambda: lab.decode(backend), warmup_ms=lab.warmup_ms, rep_ms=lab.rep_ms, device=lab.device)
    row = dict(path=backend.path, backend=backend.name, impl=backend.impl, median_ms=t.median_ms,
               p20_ms=t.p20_ms, p80_ms=t.p80_ms, **lab.shape(), **extra)
    if ceilings is not None:
        s = lab.shape()
        row.update(achieved(backend.path, t.median_ms, ceilings, pool_tokens=s["pool_tokens"],
                            tokens_read=s["tokens_read"], kv_dtype=s["kv_dtype"], heads=s["heads"],
                            batch=s["batch_size"]))
    return row


def oracle(lab: Lab, layer: int = 0) -> torch.Tensor:
    """float64 absorbed MLA over the dequantized layer: [B, H, 512]."""
    kv = lab.pool.dequant(layer, torch.float64)
    return reference.mla_decode(lab.q_nope, lab.q_pe, kv, lab.batch, lab.sm_scale)


def compare_outputs(lab: Lab, names: list[str]) -> pd.DataFrame:
    """Each backend's output against the oracle and against the first backend's, bit for bit."""
    ref = oracle(lab)
    first, rows = None, []
    for name in names:
        b = backends.get(name)
        out = _on(lab, b).decode(b)
        first = out if first is None else first
        rows.append(dict(backend=name, rel_err=reference.rel_err(out, ref), bitwise_equal_to_first=torch.equal(out, first),
                         max_abs_diff_to_first=float((out.float() - first.float()).abs().max())))
    return pd.DataFrame(rows)


def side_by_side(lab: Lab, paths=MAIN_PATHS + ("bf16_pool",), impl: str = "auto", ceilings=None) -> pd.DataFrame:
    """The paths on the lab's batch: time, bytes, extra memory (measured, predicted), roofline, error."""
    from .memory import extra_memory, predicted_extra_bytes

    ref = oracle(lab)
    rows = []
    for path in paths:
        b = pick(path, impl, lab.device)
        on = _on(lab, b)
        s = on.shape()
        err = reference.rel_err(on.decode(b), ref)
        rows.append(time_backend(
            on, b, ceilings, rel_err=err, extra_bytes=extra_memory(lambda: on.decode(b), lab.device),
            predicted_extra_bytes=predicted_extra_bytes(path, s["pool_tokens"], s["tokens_read"], s["batch_size"],
                                                        s["heads"], s["kv_dtype"])))
    return pd.DataFrame(rows)


def sweep(lab: Lab, name: str, values, make_case, names: list[str], ceilings=None) -> pd.DataFrame:
    """Time each backend in ``names`` on ``make_case(lab, v)`` for every v, with a progress bar."""
    from tqdm.auto import tqdm

    rows = []
    for v in tqdm(values, desc=name, unit="point"):
        case = make_case(lab, v)
        for n in names:
            rows.append(time_backend(case, backends.get(n), ceilings, experiment=name, swept=v))
    return pd.DataFrame(rows)


def pool_sweep(lab: Lab, sizes, names, ceilings=None) -> pd.DataFrame:
    """The same batch on one-layer pools of each size: what the pool costs each path."""
    return sweep(lab, "pool_sweep", sizes, lambda lb, n: lb.case(pool_tokens=n), names, ceilings)


def batch_sweep(lab: Lab, sizes, names, ceilings=None) -> pd.DataFrame:
    """1..n requests of the lab's context lengths on the lab's pool; ``read_fraction`` = L / pool."""
    lens = lab.p.lens
    df = sweep(lab, "batch_sweep", sizes, lambda lb, n: lb.case(lens=[lens[i % len(lens)] for i in range(n)]),
               names, ceilings)
    return df.assign(read_fraction=df.tokens_read / df.pool_tokens)


def _fitted(lab: Lab, batch: int, context: int, heads: int | None = None) -> Lab:
    pages = batch * -(-context // lab.p.page_size)
    return lab.case(pool_tokens=pages * lab.p.page_size, lens=[context] * batch, heads=heads)


def heads_sweep(lab: Lab, heads, batch: int, context: int, names, ceilings=None) -> pd.DataFrame:
    """Heads per GPU at batch x context on a pool that just fits: arithmetic intensity grows with heads."""
    return sweep(lab, "heads_sweep", heads, lambda lb, h: _fitted(lb, batch, context, h), names, ceilings)


def context_sweep(lab: Lab, contexts, batch: int, names, ceilings=None) -> pd.DataFrame:
    """Context length per request at the lab's heads, on a pool that just fits."""
    return sweep(lab, "context_sweep", contexts, lambda lb, n: _fitted(lb, batch, n), names, ceilings)


def speedup(df: pd.DataFrame, x: str, base: str = "full_pool_cast", new: str = "gather_cast") -> pd.DataFrame:
    """Median ms of two paths per value of ``x`` and base / new."""
    t = df.pivot_table(index=x, columns="path", values="median_ms")[[base, new]]
    return t.assign(speedup=t[base] / t[new]).reset_index()


def save(lab: Lab, rows, name: str) -> Path:
    """Write rows (DataFrame or dicts with TIMING_KEYS) as records ``<run_dir>/<name>.parquet``,
    replacing an earlier file of that name; each record carries the run's parameters."""
    from . import results

    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    env = results.env_info(lab.device)
    recs = []
    for r in rows:
        timing = [r.get(k, float("nan")) for k in TIMING_KEYS]
        extra = {k: v for k, v in r.items() if k not in TIMING_KEYS}
        params = {k: v for k, v in lab.p.as_dict().items() if k not in extra}
        recs.append(results.make_record(*timing, params=params, device_env=env, **extra))
    (lab.run_dir / f"{name}.parquet").unlink(missing_ok=True)
    return results.write_records(lab.run_dir, recs, name)
