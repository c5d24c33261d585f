"""Where a decode call spends host (Python) time: eager wall time per call of every backend's
planned ``run`` at one request (``labkit.timing.host_us``, rotating layers), FlashInfer's beside it,
then cProfile's top functions for each.

    python3 scripts/host_profile.py [--heads 16] [--len 8192] [--calls 200] [--layout fp8_ds_mla] [--topk 2048]

``--topk``: a sparse batch (per-layer top-k slots, so each call also takes its layer's slots);
``--layout``: the FP8 pool's row layout (the BF16 pool serves the bf16_pool backends either way).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402,F401  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402

from labkit import backends, kvpool, timing  # noqa: E402

LAYERS = 4
SM_SCALE = 1 / 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layout", default="fp8_per_tensor", choices=("fp8_per_tensor", "fp8_ds_mla"))
    ap.add_argument("--topk", type=int, default=0, help="top-k slots per layer: a sparse batch (0: dense)")
    a = ap.parse_args()
    pool8 = kvpool.random_pool(LAYERS, a.len * 2, 64, kv_layout=a.layout, device="cuda", seed=1)
    pool16 = kvpool.random_pool(LAYERS, a.len * 2, 64, kv_dtype="bf16", device="cuda", seed=1)
    batch = kvpool.make_batch(pool8.num_pages, 64, [a.len], device="cuda")
    if a.topk:
        batch = batch.with_slots(kvpool.random_slots(batch, a.topk, seed=2, num_layers=LAYERS))
    qn, qp = kvpool.make_queries(1, a.heads, device="cuda")
    for name in backends.names():
        b = backends.get(name)
        pool = pool16 if b.kv_layouts == ("bf16",) else pool8
        try:
            b.check(qn, pool, batch)
        except ValueError as e:
            print(f"== {name}: not here ({e})")
            continue
        plan = b.plan(pool, batch, a.heads, SM_SCALE, qn.dtype)
        call = lambda layer: plan.run(qn, qp, layer)  # noqa: E731
        us = timing.host_us(call, layers=LAYERS, calls=a.calls)
        pr = cProfile.Profile()
        pr.enable()
        for i in range(a.calls):
            call(i % LAYERS)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        shape = f"h{a.heads}, 1 x {a.len}" + (f", top-{a.topk}" if a.topk else "") + f", {pool.kv_layout}"
        print(f"== {name}: {us:.1f} us per eager call ({shape}, {LAYERS} rotating layers)")
        print("\n".join(s.getvalue().splitlines()[6:20]))


if __name__ == "__main__":
    main()
