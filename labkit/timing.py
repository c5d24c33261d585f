"""Timing a callable the same way everywhere: warm-up, many repeats, median with 20th/80th percentiles.

CUDA: ``triton.testing.do_bench`` (device events, L2 flushed before every timed run) or
``do_bench_cudagraph`` (replays of a captured graph, no flush), or a plain event loop when the
flush is turned off. CPU: ``time.perf_counter`` around each call, no cache flush; those figures
are marked ``device="cpu"`` and only show shapes and trends, never GPU speed.

    t = bench(lambda: backend.decode(q_nope, q_pe, pool, 0, batch, sm_scale))
    t.median_ms, t.p20_ms, t.p80_ms, t.us
    graph_times(lambda layer: plan.run(q_nope, q_pe, layer), range(4)).us   # CUDA graph, rotating layers
    host_us(lambda layer: plan.run(q_nope, q_pe, layer), layers=4)          # eager wall time per call
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

QUANTILES = (0.5, 0.2, 0.8)
MAX_REPS = 10_000  # cap on timed calls when a call is too fast to estimate
_clock = time.perf_counter  # seconds; tests swap in a fake clock


@dataclass
class Timing:
    """Statistics of one benchmark, in milliseconds per call."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    n: int  # timed samples
    device: str  # "cuda" or "cpu"
    method: str  # "cuda-events", "cuda-graph" or "perf_counter"

    @property
    def us(self) -> float:
        """Median in microseconds."""
        return self.median_ms * 1e3

    def as_dict(self) -> dict:
        return asdict(self)


def quantile(xs, q: float) -> float:
    """The ``q`` quantile of ``xs`` with linear interpolation (numpy's default, as Triton uses)."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of no samples")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times_ms, device: str, method: str) -> Timing:
    """Timing from per-call samples in milliseconds."""
    times = [float(t) for t in times_ms]
    med, p20, p80 = (quantile(times, q) for q in QUANTILES)
    return Timing(med, p20, p80, statistics.fmean(times), len(times), device, method)


def _cpu_times(fn, warmup_ms: float, rep_ms: float, min_reps: int) -> list[float]:
    """Per-call wall times (ms): warm up for ``warmup_ms`` (>= 1 call, the first one included),
    then ``rep_ms`` worth of calls, at least ``min_reps``."""
    warm = []
    while not warm or sum(warm) < warmup_ms:
        t0 = _clock()
        fn()
        warm.append((_clock() - t0) * 1e3)
    est = warm[-1]  # the latest warm call: first-call costs are behind it
    n = MAX_REPS if est <= 0 else int(rep_ms / est)
    times = []
    for _ in range(min(max(n, min_reps), MAX_REPS)):
        t0 = _clock()
        fn()
        times.append((_clock() - t0) * 1e3)
    return times


def _event_times(fn, warmup_ms: float, rep_ms: float, min_reps: int) -> list[float]:
    """do_bench's loop without the L2 flush: events around each call, warm-up first."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-6)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = min(max(min_reps, int(rep_ms / est)), MAX_REPS)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def _do_bench_times(fn, warmup_ms: float, rep_ms: float, min_reps: int) -> list[float]:
    """``triton.testing.do_bench`` samples (L2 flushed before each), topped up to ``min_reps``."""
    from triton.testing import do_bench

    times = list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
    while len(times) < min_reps:  # a slow call: ask for just enough more time to get the rest
        need = (min_reps - len(times)) * statistics.median(times) * 1.5
        times += do_bench(fn, warmup=0, rep=need, return_mode="all")
    return times


def bench(fn, *, warmup_ms: float = 25, rep_ms: float = 100, flush_l2: bool = True,
          cuda_graph: bool = False, device=None, min_reps: int = 3) -> Timing:
    """Time ``fn()`` (no arguments). ``device`` None: CUDA when available, else CPU.

    CUDA work must be on the current device of ``device``. ``cuda_graph`` captures ``fn`` in a
    graph (it must be capturable) and never flushes L2; on the CPU both flags are ignored.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return summarize(_cpu_times(fn, warmup_ms, rep_ms, min_reps), "cpu", "perf_counter")
    with torch.cuda.device(dev):
        if cuda_graph:
            from triton.testing import do_bench_cudagraph

            return summarize(do_bench_cudagraph(fn, rep=rep_ms, return_mode="all"), "cuda", "cuda-graph")
        sampler = _do_bench_times if flush_l2 else _event_times
        return summarize(sampler(fn, warmup_ms, rep_ms, min_reps), "cuda", "cuda-events")


def host_us(fn, layers: int = 1, calls: int = 50, repeats: int = 5, warmup: int = 3, device=None) -> float:
    """Wall microseconds per eager call of ``fn(layer)``: loops of ``calls`` calls rotating over
    ``layers``, one synchronize at the end of each loop, median over ``repeats`` loops.

    At one request the GPU finishes each call long before the host issues the next, so this is
    the host's cost per call (Python, checks, allocations, launches), what a server pays per layer
    without CUDA graphs. ``warmup`` loops first (compilation, plans)."""
    if repeats < 1:
        raise ValueError(f"calls={calls}, repeats={repeats}, layers={layers}: each must be >= 1")
    return host_us_interleaved({"fn": fn}, layers=layers, calls=calls, rounds=repeats, warmup=warmup,
                               device=device)["fn"]


def host_us_interleaved(fns: dict, layers: int = 1, calls: int = 50, rounds: int = 7, warmup: int = 2,
                        device=None) -> dict:
    """``host_us`` of several callables side by side: each round times one loop of ``calls`` calls of
    every callable in turn (rotating over ``layers``, a synchronize closing each loop); per callable
    the median over ``rounds``. A host whose speed drifts (another process, clocks) then shifts all
    of them alike, where one after another it would favour whichever ran in a quiet spell."""
    if calls < 1 or rounds < 1 or layers < 1:
        raise ValueError(f"calls={calls}, rounds={rounds}, layers={layers}: each must be >= 1")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per_call = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            sync()
            t0 = _clock()
            for i in range(calls):
                fn(i % layers)
            sync()
            if r >= warmup:
                per_call[name].append((_clock() - t0) / calls * 1e6)
    return {name: quantile(v, 0.5) for name, v in per_call.items()}


def graph_times(fn_of_layer, layers, *, replays: int = 20, warmup: int = 2, device=None) -> Timing:
    """Median time of one call of ``fn_of_layer(layer)``, per call, over rotating layers.

    CUDA: one graph captures one call per layer of ``layers`` (several layers, so that the KV a
    call reads has left L2 by the time its layer comes round again, as in a decode step), is
    replayed ``warmup`` then ``replays`` times with device events around each replay; each sample
    is replay time / len(layers). The calls run once eagerly first (compiles, plans). Two rounds
    (capture, warm-up, timed replays) are made and the one with the lower median is kept: on the
    H200 the first timing after a new pool or a float64 reference ran 8% slower through all its
    replays, at the SM clock of the next one (16 heads 64 x 8K: 97.6 and 96.5 against 88-90 us,
    runs 13c-d), which favoured whatever was timed second.
    CPU: the same rotation timed with ``time.perf_counter`` (shapes and trends only)."""
    layers = list(layers)
    if not layers:
        raise ValueError("graph_times: layers is empty; give at least one layer")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        times = []
        for _ in range(warmup + replays):
            t0 = _clock()
            for layer in layers:
                fn_of_layer(layer)
            times.append((_clock() - t0) * 1e3 / len(layers))
        return summarize(times[warmup:], "cpu", "perf_counter")
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up off the default stream, as capture wants
            for layer in layers:
                fn_of_layer(layer)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        rounds = [_graph_round(fn_of_layer, layers, replays, warmup) for _ in range(2)]
    return summarize(min(rounds, key=statistics.median), "cuda", "cuda-graph")


def _graph_round(fn_of_layer, layers, replays: int, warmup: int) -> list[float]:
    """One capture of the rotation, ``warmup`` replays, then ``replays`` timed ones: ms per call."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn_of_layer(layer)
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / len(layers) for s, e in events]
    del graph
    return times
