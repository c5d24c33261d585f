"""The experiments the notebooks share: one decode batch on a pool, paths side by side, sweeps.

    lab = Lab.build(LabParams.make(model="glm5", tp_size=4, ...), run_dir, warmup_ms=25, rep_ms=100)
    rows = side_by_side(lab, ["full_pool_cast", "gather_cast", "fp8_native"], impl="auto", ceilings=c)
    lab.save(rows, "03_paths")             # records into the run folder (labkit.results)

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
from tqdm.auto import tqdm

from . import backends, config, reference, results
from .config import DATA_DIR, KV_BYTES, LabParams, load_model
from .kvpool import DecodeBatch, KVPool, batch_for_pool, make_queries, random_pool
from .memory import extra_memory, predicted_extra_bytes
from .profiling import CATEGORIES, profile_decode_step
from .roofline import achieved, mma_of
from .stepmodel import predict, rest_from_seed
from .timing import bench, graph_times, host_us

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


def fastest_fp8_native(records: pd.DataFrame, value: str = "device_ms") -> pd.Series:
    """The record of the fastest of our ``fp8_native`` kernels (peers left out): the minimum of
    ``value`` over those records; what notebook 03 reports."""
    ours = records[(records.path == "fp8_native") & (records.impl != "flashinfer") & records[value].notna()]
    if ours.empty:
        raise ValueError(f"no fp8_native records with {value!r} among {len(records)} records")
    return ours.iloc[int(ours[value].to_numpy().argmin())]  # by position: concatenated records repeat labels


def _on(lab: Lab, backend) -> Lab:
    """The lab a backend reads: ``bf16_pool`` backends get the BF16 copy of the pool."""
    return lab.bf16() if backend.path == "bf16_pool" and lab.pool.kv_dtype != "bf16" else lab


def time_backend(lab: Lab, backend, ceilings=None, **extra) -> dict:
    """One row for one layer of ``backend`` on the lab's batch: ``median_ms``/``p20_ms``/``p80_ms`` a
    call (labkit.timing, host included), ``graph_us`` and ``host_us`` on a GPU (``_graph_and_host``),
    ``device_ms`` of its kernels and ``<category>_ms`` split
    (labkit.profiling, median of 3), the shape and ``extra``; with ``ceilings`` also bytes, GB/s,
    TFLOP/s and % of roofline of the device time (labkit.roofline.achieved)."""
    lab = _on(lab, backend)
    t = bench(lambda: lab.decode(backend), warmup_ms=lab.warmup_ms, rep_ms=lab.rep_ms, device=lab.device)
    prof = profile_step(lab, backend, layers=[0], repeats=3).set_index("category").device_ms
    s = lab.shape()
    row = dict(path=backend.path, backend=backend.name, impl=backend.impl, median_ms=t.median_ms,
               p20_ms=t.p20_ms, p80_ms=t.p80_ms, device_ms=prof["total"], **_graph_and_host(lab, backend),
               **{f"{c}_ms": prof[c] for c in CATEGORIES}, cast_share=prof["cast"] / prof["total"], **s, **extra)
    if ceilings is not None:
        row.update(achieved(backend.path, row["device_ms"], ceilings, mma=mma_of(backend.name),
                            pool_tokens=s["pool_tokens"], tokens_read=s["tokens_read"], kv_dtype=s["kv_dtype"],
                            heads=s["heads"], batch=s["batch_size"], kv_layout=s["kv_layout"]),
                   copy_gbps=ceilings.copy_gbps, matmul_tflops=ceilings.matmul_tflops, fp8_tflops=ceilings.fp8_tflops,
                   mma=mma_of(backend.name), precision=backend.precision)
    return row


def _graph_and_host(lab: Lab, backend) -> dict:
    """On a GPU, for a capturable backend (not the torch references): ``graph_us`` (CUDA-graph
    replays of the planned call over up to 4 rotating layers) and ``host_us`` (eager wall time per
    call); NaN elsewhere."""
    if not str(lab.device).startswith("cuda") or backend.impl == "torch":
        return dict(graph_us=float("nan"), host_us=float("nan"))
    plan = backend.plan(lab.pool, lab.batch, lab.q_nope.shape[1], lab.sm_scale, lab.q_nope.dtype)
    call = lambda layer: plan.run(lab.q_nope, lab.q_pe, layer)  # noqa: E731
    layers = range(min(4, lab.pool.num_layers))
    return dict(graph_us=graph_times(call, layers, device=lab.device).us,
                host_us=host_us(call, layers=len(layers), device=lab.device))


# (backend, on the BF16 copy of the pool): our FP8 kernels (the Gluon one where the device, page size and
# head count allow) and FlashInfer's MLA kernels
PEERS = (("fp8_native.triton_q8", False), ("fp8_native.gluon", False), ("fp8_native.triton_rows", False),
         ("fp8_native.triton_rows_acc", False),
         ("flashinfer_mla", False), ("flashinfer_mla", True), ("flashinfer_mla_fp8", False))


def peers(lab: Lab, ceilings=None) -> pd.DataFrame:
    """The peers on the lab's batch, each checked against the oracle, then timed; a peer that is not
    here (FlashInfer absent, a CPU) is a row whose ``note`` says why."""
    ref = oracle(lab)
    rows = []
    for name, on_bf16 in PEERS:
        label = name + (" [BF16 pool]" if on_bf16 else " [FP8 pool]")
        on = lab.bf16() if on_bf16 and lab.pool.kv_dtype != "bf16" else lab
        try:
            b = backends.get(name)
            b.check(on.q_nope, on.pool)
        except ValueError as e:
            rows.append(dict(label=label, backend=name, note=str(e)))
            continue
        err = reference.rel_err(on.decode(b), ref)
        rows.append(dict(label=label, note="", **time_backend(on, b, ceilings, rel_err=err, experiment="peers")))
    return pd.DataFrame(rows)


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
        rows.append(dict(path=b.path, backend=name, impl=b.impl, rel_err=reference.rel_err(out, ref), bitwise_equal_to_first=torch.equal(out, first),
                         max_abs_diff_to_first=float((out.float() - first.float()).abs().max())))
    return pd.DataFrame(rows)


def side_by_side(lab: Lab, paths=MAIN_PATHS + ("bf16_pool",), impl: str = "auto", ceilings=None,
                 precision: str = "fast") -> pd.DataFrame:
    """The paths on the lab's batch, each by ``pick`` (``auto``: ``backends.select`` at ``precision``):
    time, bytes, extra memory (measured, predicted), roofline, error."""
    ref = oracle(lab)
    rows = []
    for path in paths:
        b = pick(path, impl, lab.device, precision, lab)
        on = _on(lab, b)
        s = on.shape()
        err = reference.rel_err(on.decode(b), ref)
        rows.append(time_backend(
            on, b, ceilings, rel_err=err, extra_bytes=extra_memory(lambda: on.decode(b), lab.device),
            predicted_extra_bytes=predicted_extra_bytes(path, s["pool_tokens"], s["tokens_read"], s["batch_size"],
                                                        s["heads"], s["kv_dtype"]), experiment="paths"))
    return pd.DataFrame(rows)


def sweep(lab: Lab, name: str, values, make_case, names: list[str], ceilings=None) -> pd.DataFrame:
    """Time each backend in ``names`` on ``make_case(lab, v)`` for every v, with a progress bar. A
    path name (``fp8_native``) is resolved by ``select`` at each point: the fastest implementation
    whose rules allow that point (a kernel limited to 32 heads gives way at 64)."""
    rows = []
    for v in tqdm(values, desc=name, unit="point"):
        case = make_case(lab, v)
        for n in names:
            b = backends.get(n) if "." in n else pick(n, "auto", case.device, "fast", case)
            rows.append(time_backend(case, b, ceilings, experiment=name, swept=v))
        del case
        backends.clear_plans()  # cached plans hold the case's pool
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


def speedup(df: pd.DataFrame, x: str, base: str = "full_pool_cast", new: str = "gather_cast",
            value: str = "device_ms") -> pd.DataFrame:
    """``value`` (default: the kernels' device time) of two paths per value of ``x``, and base / new."""
    t = df.pivot_table(index=x, columns="path", values=value)[[base, new]]
    return t.assign(speedup=t[base] / t[new]).reset_index()


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


# -- profiles of the decode step ----------------------------------------------------------------------
_profiler_started = False


def profile_step(lab: Lab, backend, layers=None, repeats: int = 1, trace_path=None) -> pd.DataFrame:
    """labkit.profiling's breakdown of one decode step (all the pool's layers) as rows with timing
    keys; with ``repeats`` > 1 the per-category median of that many profiled steps. ``trace_path``
    (e.g. in the run folder): the first profiled step's Chrome trace (chrome://tracing, Perfetto)."""
    global _profiler_started
    run = lambda n, trace=None: profile_decode_step(  # noqa: E731
        backend, lab.q_nope, lab.q_pe, lab.pool, lab.batch, lab.sm_scale, layers=n, trace_path=trace)
    if not _profiler_started:  # the first profile in a process pays the profiler's start-up: not this one
        run(1)
        _profiler_started = True
    profs = [run(layers, trace_path if i == 0 else None) for i in range(repeats)]
    df = profs[0].copy()
    df["device_ms"] = pd.concat([p.device_ms for p in profs], axis=1).median(axis=1)
    total = df.device_ms[df.category != "total"].sum()
    df.loc[df.category == "total", "device_ms"] = total
    df["share"] = df.device_ms / total if total else 0.0
    return df.assign(path=backend.path, backend=backend.name, impl=backend.impl, median_ms=df.device_ms,
                     p20_ms=df.device_ms, p80_ms=df.device_ms, activity=profs[0].attrs["activity"],
                     layers_profiled=profs[0].attrs["layers"], repeats=repeats, **lab.shape())


def share(profile: pd.DataFrame, category: str = "cast") -> float:
    return float(profile.set_index("category").loc[category, "share"])


def cast_share_sweep(lab: Lab, sizes, backend) -> pd.DataFrame:
    """One backend on one-layer pools of each size: the profiler's cast / attention split per size."""
    return sweep(lab, "cast_share_sweep", sizes, lambda lb, n: lb.case(pool_tokens=n), [backend.name])


def break_even(sp: pd.DataFrame, x: str = "read_fraction"):
    """The smallest ``x`` at which the speedup is 1 or less; None if it pays everywhere swept."""
    lost = sp[sp.speedup <= 1]
    return None if lost.empty else float(lost[x].min())


# -- the report: from recorded runs to a decode step ------------------------------------------------
SEED_TOK_S = {"full_pool_cast": 10.5, "gather_cast": 13.5}  # the study's single stream


def step_table(df: pd.DataFrame, rest_ms: float | None = None) -> pd.DataFrame:
    """Decode step and tok/s per path and run from the recorded side-by-side (``paths`` rows).

    step = model layers x (path ms - bf16_pool ms) + rest: what each path adds to a BF16 kernel
    on a BF16 pool, with the rest of the step (the attention kernel included) from the seed. ms is
    the kernels' device time (a server replays decode as a CUDA graph: no launch cost).
    Without a bf16_pool row the path's whole time counts (an upper bound on the step).
    """
    rest = rest_from_seed() if rest_ms is None else rest_ms
    tables, paths_rows = [], records_of(df, "paths")
    for run, d in (paths_rows.groupby("run") if len(paths_rows) else []):
        d = d.sort_values("env_timestamp").groupby("path").last()
        ms = d.device_ms if "device_ms" in d else d.median_ms
        base = ms.get("bf16_pool", 0.0)
        layers = load_model(d.model.iloc[0]).num_hidden_layers
        paths = [p for p in MAIN_PATHS if p in d.index]
        t = predict({p: ms[p] - base for p in paths}, layers, rest)
        tables.append(t.assign(run=run, device=d.env_device_name.iloc[0], ms_per_layer=ms[paths].values,
                               layers=layers, rest_ms=rest, seed_tok_s=[SEED_TOK_S.get(p) for p in paths],
                               rel_err=d.rel_err[paths].values))
    cols = ["run", "device", "path", "ms_per_layer", "layers", "rest_ms", "step_ms", "tok_s", "seed_tok_s", "rel_err"]
    return pd.concat(tables)[cols].reset_index(drop=True) if tables else pd.DataFrame(columns=cols)


# -- figures (each returns the axes; save with labkit.plots.savefig(ax.figure, ...)) ---------------
def _axes(ax=None, size=(6, 3.6)):
    import matplotlib.pyplot as plt

    return ax if ax is not None else plt.subplots(figsize=size)[1]


def plot_cast_share(sw: pd.DataFrame, ax=None):
    """Cast and attention ms per layer against pool size, with the cast's share on the right."""
    ax = _axes(ax)
    ax.plot(sw.pool_tokens, sw.cast_ms, "o-", label="cast")
    ax.plot(sw.pool_tokens, sw.attention_ms, "s-", label="attention")
    ax.set(xscale="log", yscale="log", xlabel="pool tokens per layer", ylabel="ms per layer (profiled)")
    right = ax.twinx()
    right.plot(sw.pool_tokens, 100 * sw.cast_share, "k:", label="cast share")
    right.set(ylabel="cast share of the layer (%)", ylim=(0, 100))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"the cast grows with the pool ({sw.tokens_read.iloc[0]:,} tokens read)")
    return ax


def plot_speedup(sp: pd.DataFrame, x: str, xlabel: str, ax=None, logx: bool = False):
    """gather_cast's speedup over full_pool_cast against ``x``; 1 = break-even."""
    ax = _axes(ax)
    ax.plot(sp[x], sp.speedup, "o-")
    ax.axhline(1, color="grey", ls=":")
    ax.set(xlabel=xlabel, ylabel="speedup of gather_cast (x)", title="gather-then-cast against the whole-pool cast")
    if logx:
        ax.set_xscale("log")
    return ax


def plot_paths(paths: pd.DataFrame, ax=None):
    """One layer's device time per backend, labelled with the time a call takes and % of the roofline."""
    ax = _axes(ax)
    dev, call = paths.device_ms * 1e3, paths.median_ms * 1e3
    ax.barh(paths.backend, dev, color="tab:blue")
    pct = paths.pct_roofline if "pct_roofline" in paths else [float("nan")] * len(paths)
    for y, (d, c, r) in enumerate(zip(dev, call, pct)):
        label = f" {d:,.0f} us ({c:,.0f} a call)" + ("" if r != r else f", {r:.0f}% of roofline")
        ax.annotate(label, (d, y), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="device time per layer (us, profiled kernels)", ylabel="backend",
           title=f"{paths.batch_size.iloc[0]} x {paths.context_len.iloc[0]:,} tokens, pool {paths.pool_tokens.max():,}")
    ax.set_xlim(0, dev.max() * 1.8)
    return ax


def plot_tok_s(steps: pd.DataFrame, ax=None):
    """Modelled tokens/s per path beside the seed's measured figures."""
    import numpy as np

    ax = _axes(ax)
    x = np.arange(len(steps))
    ax.bar(x - 0.2, steps.tok_s, 0.4, label="this lab (decode-step model)")
    ax.bar(x + 0.2, steps.seed_tok_s.astype(float).fillna(0), 0.4, label="seed (measured)")
    many = steps.run.nunique() > 1
    ax.set_xticks(x, [f"{p}\n{d}" if many else p for p, d in zip(steps.path, steps.device)], fontsize=8)
    ax.set(xlabel="decode path", ylabel="tokens/s, one stream",
           title=f"decode step: {steps.layers.iloc[0]} layers on {steps.device.iloc[0]} + the seed's rest")
    ax.legend(fontsize=8)
    return ax
