"""From one layer's attention time to a decode step and tokens per second.

    step_ms = layers x (attention path per layer) + rest_ms

``predict_selected`` measures, per path, the implementation ``backends.select`` picks for the call.
``rest_ms`` is everything else in the step (MoE, projections, sampling, the attention kernel
itself when the path time counts only the cast). The seed's figures fix it: a single stream at
10.5 tok/s is a 95.2 ms step, of which the whole-pool cast took 64.6 ms, leaving 30.6 ms.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd

from .roofline import path_bytes


@dataclass(frozen=True)
class Seed:
    """The seed's measurements (GLM-5, SGLang, one request, FP8 KV pool)."""

    cast_ms_per_step: float = 64.6  # whole-pool FP8 -> BF16 cast, all layers
    cast_share: float = 0.69  # of decode time, as profiled
    tok_s: float = 10.5  # full_pool_cast, single stream
    gather_cast_tok_s: float = 13.5  # after switching to gather-then-cast
    pool_tokens: int = 495_000
    layers: int = 78
    batch: int = 1
    device: str = "RTX PRO 6000 Blackwell (SM120)"

    def as_dict(self) -> dict:
        return asdict(self)


SEED = Seed()


def step_ms(attn_ms_per_layer: float, layers: int, rest_ms: float) -> float:
    """One decode step in ms."""
    return layers * attn_ms_per_layer + rest_ms


def tokens_per_s(step_ms: float, batch: int = 1) -> float:
    """Generated tokens per second: one token per request per step."""
    return batch * 1e3 / step_ms


def seed_step_ms(seed: Seed = SEED) -> float:
    """The seed's step from its tok/s: 1000 / 10.5 = 95.24 ms."""
    return seed.batch * 1e3 / seed.tok_s


def rest_from_seed(seed: Seed = SEED) -> float:
    """The step minus the whole-pool cast: 95.24 - 64.6 = 30.64 ms (attention kernel included)."""
    return seed_step_ms(seed) - seed.cast_ms_per_step


def cast_ms_per_layer(seed: Seed = SEED) -> float:
    """64.6 ms / 78 layers = 0.828 ms for one layer's whole-pool cast."""
    return seed.cast_ms_per_step / seed.layers


def seed_cast_gbps(seed: Seed = SEED) -> float:
    """Bandwidth the seed's cast achieved: P*(576 + 1152) bytes per layer in ``cast_ms_per_layer``."""
    nbytes = path_bytes("full_pool_cast", seed.pool_tokens, 0)  # cast bytes only: L = 0, no q/out
    return nbytes / cast_ms_per_layer(seed) / 1e6


def _gather_cast_ms(tokens: int, seed: Seed) -> float:
    """Per-step cost of gathering and casting ``tokens`` rows per layer at the seed's cast bandwidth."""
    cast_bytes = tokens * (576 + 1152)  # read FP8 row + write BF16 row
    return seed.layers * cast_bytes / seed_cast_gbps(seed) / 1e6


def seed_check(context_tokens=(8_192, 131_072, 495_000), seed: Seed = SEED) -> pd.DataFrame:
    """What the model says against the seed: rows (path, assumption, step_ms, tok_s, seed_tok_s).

    - full_pool_cast: the seed itself (rest + cast = 10.5 tok/s by construction).
    - gather_cast at each context length: rest + the cast of only those rows at the seed's cast
      bandwidth (the attention kernel's own time stays in ``rest``).
    - gather_cast as measured: the seed's 13.5 tok/s, and the context that would explain it.
    - fp8_native: rest alone, no cast pass (an upper bound on speed only if attention over FP8
      costs what BF16 attention did; it reads half the bytes).
    """
    rest = rest_from_seed(seed)
    rows = [dict(path="full_pool_cast", assumption="seed: whole-pool cast + rest",
                 step_ms=rest + seed.cast_ms_per_step, seed_tok_s=seed.tok_s)]
    for n in context_tokens:
        rows.append(dict(path="gather_cast", assumption=f"cast only {n:,} read tokens per layer",
                         step_ms=rest + _gather_cast_ms(n, seed), seed_tok_s=seed.gather_cast_tok_s))
    measured = seed.batch * 1e3 / seed.gather_cast_tok_s
    implied = (measured - rest) / _gather_cast_ms(1, seed)
    rows.append(dict(path="gather_cast", assumption=f"seed's 13.5 tok/s = {implied:,.0f} tokens cast per layer",
                     step_ms=measured, seed_tok_s=seed.gather_cast_tok_s, implied_tokens=implied))
    rows.append(dict(path="fp8_native", assumption="no cast pass: rest only", step_ms=rest, seed_tok_s=None))
    df = pd.DataFrame(rows)
    df.insert(3, "tok_s", [tokens_per_s(s, seed.batch) for s in df.step_ms])
    df["vs_seed_gather"] = df.tok_s / seed.gather_cast_tok_s
    return df


def predict(path_ms_per_layer: dict, layers: int, rest_ms: float, batch: int = 1) -> pd.DataFrame:
    """Step time and tok/s per path from measured per-layer times: DataFrame(path, step_ms, tok_s)."""
    rows = []
    for path, ms in path_ms_per_layer.items():
        s = step_ms(ms, layers, rest_ms)
        rows.append(dict(path=path, step_ms=s, tok_s=tokens_per_s(s, batch)))
    return pd.DataFrame(rows, columns=["path", "step_ms", "tok_s"])


def selected_layer_ms(q_nope, q_pe, pool, batch, sm_scale: float, paths=("full_pool_cast", "gather_cast", "fp8_native"),
                      precision: str = "fast", layers: int = 4) -> dict:
    """Per path, the implementation ``backends.select`` picks for this call and one layer's ms:
    {path: (backend name, ms)}. On a GPU the CUDA-graph median over ``layers`` rotating layers (a
    server replays decode as a graph); on a CPU the eager time of layer 0.

    q_nope [B, H, 512], q_pe [B, H, 64] bf16; pool: a KVPool the paths read; batch: its DecodeBatch."""
    from . import backends, timing

    out = {}
    n = range(min(layers, pool.num_layers))
    for path in paths:
        b = backends.select(path, q_nope, pool, batch, precision)
        plan = b.plan(pool, batch, q_nope.shape[1], sm_scale, q_nope.dtype)
        call = lambda layer: plan.run(q_nope, q_pe, layer)  # noqa: E731
        if pool.device.type == "cuda" and b.impl != "torch":
            ms = timing.graph_times(call, n, device=pool.device).median_ms
        else:
            ms = timing.bench(lambda: call(0), warmup_ms=5, rep_ms=20, device=pool.device).median_ms
        out[path] = (b.name, ms)
    return out


def predict_selected(q_nope, q_pe, pool, batch, sm_scale: float, model_layers: int, rest_ms: float,
                     paths=("full_pool_cast", "gather_cast", "fp8_native"), precision: str = "fast") -> pd.DataFrame:
    """``predict`` from what ``select`` picks and measures here: DataFrame(path, backend, ms_per_layer,
    step_ms, tok_s), one token per request per step."""
    picked = selected_layer_ms(q_nope, q_pe, pool, batch, sm_scale, paths, precision)
    df = predict({p: ms for p, (_, ms) in picked.items()}, model_layers, rest_ms, batch.batch_size)
    return df.assign(backend=[picked[p][0] for p in df.path], ms_per_layer=[picked[p][1] for p in df.path])
