"""Timing a lab: one backend's row, the paths side by side, peers, sweeps, profiles of a step.

    rows = side_by_side(lab, ["full_pool_cast", "gather_cast", "fp8_native"], impl="auto", ceilings=c)

Times are of ONE layer (layer 0) unless a column says otherwise; a decode step is ``layers`` of
them plus the rest of the model (labkit.stepmodel). Every row names its shape: pool_tokens,
batch_size, heads, tokens_read (L), context_len (the longest request).
"""
from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from . import backends, reference
from .lab import MAIN_PATHS, Lab, _on, oracle, pick
from .memory import extra_memory, predicted_extra_bytes
from .profiling import CATEGORIES, profile_decode_step
from .roofline import achieved, mma_of
from .timing import bench, graph_times, host_us


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
                   mma=mma_of(backend.name), precision=backend.precision_on(lab.pool.kv_layout))
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
PEERS = (("fp8_native.triton_q8", False), ("fp8_native.gluon", False), ("fp8_native.gluon_acc", False),
         ("fp8_native.triton_rows", False),
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
