"""Where a decode call spends host (Python) time: per-call wall time of whole calls with the GPU not
the bottleneck (one request), then cProfile's top functions for each kernel launcher.

    python3 scripts/host_profile.py [--heads 16] [--len 8192]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402

import torch  # noqa: E402

from labkit import kvpool  # noqa: E402

LAUNCHERS = {"bf16": gk.mla_decode, "gather": gk.mla_decode_fp8, "tma": gk.mla_decode_fp8_tma,
             "gluon": gk.mla_decode_fp8_gluon}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    pool8 = kvpool.random_pool(1, a.len * 2, 64, device="cuda", seed=1)
    pool16 = kvpool.random_pool(1, a.len * 2, 64, kv_dtype="bf16", device="cuda", seed=1)
    batch = kvpool.make_batch(pool8.num_pages, 64, [a.len], device="cuda")
    qn, qp = kvpool.make_queries(1, a.heads, device="cuda")
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    for name, fn in LAUNCHERS.items():
        call = (lambda: fn(qn, qp, pool16.layer(0), *idx, max_len=a.len)) if name == "bf16" else \
            (lambda: fn(qn, qp, pool8.layer(0), *idx, pool8.scale(0), max_len=a.len))
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.calls):
            call()
        host = (time.perf_counter() - t) / a.calls
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / a.calls
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            call()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        print(f"== {name}: host {host * 1e6:.1f} us/call, wall {wall * 1e6:.1f} us/call (h{a.heads}, 1 x {a.len})")
        print("\n".join(s.getvalue().splitlines()[6:20]))


if __name__ == "__main__":
    main()
