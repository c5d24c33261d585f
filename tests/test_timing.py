"""labkit.timing: percentile arithmetic, the CPU loop on a fake clock, a real sleep, CUDA paths."""
import time

import numpy as np
import pytest
import torch

from labkit import timing
from labkit.timing import Timing, bench, quantile, summarize

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeClock:
    """A clock that only moves when the timed function says how long it took."""

    def __init__(self, durations_ms):
        self.now, self.durations, self.calls = 0.0, list(durations_ms), 0

    def __call__(self):
        return self.now

    def fn(self):
        self.now += self.durations[self.calls] / 1e3
        self.calls += 1


def test_quantile_hand_counts():
    xs = [5, 1, 4, 2, 3]
    assert quantile(xs, 0.5) == 3
    assert quantile(xs, 0.2) == pytest.approx(1.8)  # position 0.8 between 1 and 2
    assert quantile(xs, 0.8) == pytest.approx(4.2)  # position 3.2 between 4 and 5
    assert quantile([7.0], 0.2) == 7.0


def test_quantile_matches_numpy():
    xs = np.random.default_rng(0).exponential(size=101)
    for q in (0.2, 0.5, 0.8):
        assert quantile(xs.tolist(), q) == pytest.approx(float(np.quantile(xs, q)))


def test_summarize_fields():
    t = summarize([1.0, 3.0, 5.0], "cpu", "perf_counter")
    assert (t.median_ms, t.mean_ms, t.n) == (3.0, 3.0, 3)
    assert t.p20_ms == pytest.approx(1.8) and t.p80_ms == pytest.approx(4.2)
    assert t.us == pytest.approx(3000.0)
    assert t.as_dict() == dict(median_ms=3.0, p20_ms=t.p20_ms, p80_ms=t.p80_ms, mean_ms=3.0, n=3,
                               device="cpu", method="perf_counter")


def test_cpu_loop_on_fake_clock(monkeypatch):
    # warm-up: 3 calls of 10 ms reach warmup_ms=25; estimate 10 ms -> 100 / 10 = 10 timed calls
    timed = [float(v) for v in range(10, 0, -1)]
    clock = FakeClock([10, 10, 10] + timed)
    monkeypatch.setattr(timing, "_clock", clock)
    t = bench(clock.fn, warmup_ms=25, rep_ms=100, device="cpu")
    assert clock.calls == 13
    assert (t.n, t.device, t.method) == (10, "cpu", "perf_counter")
    assert t.median_ms == pytest.approx(np.median(timed))
    assert t.p20_ms == pytest.approx(np.quantile(timed, 0.2))
    assert t.p80_ms == pytest.approx(np.quantile(timed, 0.8))
    assert t.mean_ms == pytest.approx(5.5)


def test_slow_call_still_gets_min_reps(monkeypatch):
    clock = FakeClock([900, 500, 700, 600])  # one warm-up call, then rep_ms=100 buys zero calls
    monkeypatch.setattr(timing, "_clock", clock)
    t = bench(clock.fn, warmup_ms=25, rep_ms=100, device="cpu", min_reps=3)
    assert clock.calls == 4 and t.n == 3
    assert t.median_ms == pytest.approx(600) and t.mean_ms == pytest.approx(600)


def test_real_sleep_is_measured():
    t = bench(lambda: time.sleep(0.002), warmup_ms=4, rep_ms=30, device="cpu")
    assert t.device == "cpu" and t.n >= 3
    assert 1.9 <= t.median_ms < 50  # sleep never returns early; a busy machine can add a lot
    assert t.p20_ms <= t.median_ms <= t.p80_ms


def test_timing_is_a_dataclass_with_the_agreed_fields():
    assert list(Timing.__dataclass_fields__) == ["median_ms", "p20_ms", "p80_ms", "mean_ms", "n", "device", "method"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("flush_l2, cuda_graph, method", [(True, False, "cuda-events"),
                                                          (False, False, "cuda-events"),
                                                          (False, True, "cuda-graph")])
def test_cuda_bench(flush_l2, cuda_graph, method):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ a, flush_l2=flush_l2, cuda_graph=cuda_graph)
    assert (t.device, t.method) == ("cuda", method) and t.n >= 3
    ms_floor = 2 * 4096**3 / 2000e12 * 1e3  # faster than 2 PFLOP/s would be impossible on an H200
    assert ms_floor < t.p20_ms <= t.median_ms <= t.p80_ms < 100


@pytest.mark.gpu
@needs_cuda
def test_cuda_slow_call_gets_min_reps():
    torch.cuda._sleep(int(2e8))  # load the sleep kernel before timing
    t = bench(lambda: torch.cuda._sleep(int(2e8)), warmup_ms=1, rep_ms=1, min_reps=3)
    assert t.n >= 3


def test_host_us_is_wall_time_per_call_over_rotating_layers(monkeypatch):
    # 2 warm-up loops then 3 timed loops of 4 calls; loop r costs (r + 1) ms per call
    seen = []

    class Clock:
        now = 0.0

    def fn(layer):
        seen.append(layer)
        Clock.now += (len(seen) - 1) // 4 + 1

    monkeypatch.setattr(timing, "_clock", lambda: Clock.now / 1e3)
    us = timing.host_us(fn, layers=3, calls=4, repeats=3, warmup=2, device="cpu")
    assert seen[:4] == [0, 1, 2, 0] and len(seen) == 20
    assert us == pytest.approx(4000.0)  # timed loops cost 3, 4, 5 ms a call: median 4 ms
    with pytest.raises(ValueError, match="calls=0"):
        timing.host_us(fn, calls=0, device="cpu")


def test_host_us_interleaved_shifts_every_callable_alike(monkeypatch):
    """Rounds alternate the callables; a host that slows down from round to round (each round 1 ms a
    call slower) moves both medians alike, so their difference is their own (a costs 1 ms more)."""
    order = []

    class Clock:
        now = 0.0

    def make(name, extra):
        def fn(layer):
            order.append((name, layer))
            rnd = (len(order) - 1) // 6  # 3 calls of a, 3 of b per round
            Clock.now += rnd + 1 + extra
        return fn

    monkeypatch.setattr(timing, "_clock", lambda: Clock.now / 1e3)
    us = timing.host_us_interleaved({"a": make("a", 1), "b": make("b", 0)}, layers=2, calls=3, rounds=3, warmup=1,
                                    device="cpu")
    assert order[:6] == [("a", 0), ("a", 1), ("a", 0), ("b", 0), ("b", 1), ("b", 0)] and len(order) == 24
    assert us["a"] == pytest.approx(4000.0) and us["b"] == pytest.approx(3000.0)  # rounds 1-3 cost 2-4 ms (+1 for a)
    with pytest.raises(ValueError, match="rounds=0"):
        timing.host_us_interleaved({"a": make("a", 0)}, rounds=0, device="cpu")
