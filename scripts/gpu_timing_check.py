#!/usr/bin/env python3
"""Does a CUDA-graph timing depend on what ran just before it? One call (the Gluon FP8 decode, 16
heads, 64 x 8K, pages of 64) timed by single rounds of ``labkit.timing._graph_round`` (capture, two
warm-up replays, 20 timed) and by ``labkit.timing.graph_times`` (two such rounds, the lower median
kept), first on a fresh pool, then right after a float64 reference and after a new pool. Run 13c-d
(H200): the first single round after a reference ran 8% slower (96.5-97.7 against 88-90 us) at an
unchanged SM clock; the next round did not.

    PYTHONUNBUFFERED=1 python3 scripts/gpu_timing_check.py --out DIR     # writes timing_check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402

from labkit import kvpool, reference, timing  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402

H, B, L, LAYERS = 16, 64, 8192, 4


def case(seed: int):
    pool = kvpool.random_pool(LAYERS, int(B * L * 1.05) // 64 * 64 + 64, 64, device="cuda", seed=seed)
    batch = kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)

    def call(layer):
        return mla_decode_fp8_gluon(qn, qp, pool.layer(layer), *idx, k_scale=pool.scale(layer), max_len=L)

    def ref():
        return reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
    return call, ref


def one_round(call) -> float:
    call(0)
    torch.cuda.synchronize()
    ms = timing._graph_round(call, range(LAYERS), replays=20, warmup=2)
    return 1e3 * sorted(ms)[len(ms) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []

    def rec(when, how, us):
        rows.append(dict(when=when, how=how, us=round(us, 1)))
        gk.log(f"{when:28s} {how:12s} {us:7.1f} us")

    call, ref = case(1)
    ref()
    for i in range(3):
        rec("fresh pool, after reference", f"round {i}", one_round(call))
    for when in ("after reference", "new pool"):
        for how in ("round", "graph_times"):
            if when == "new pool":
                del call, ref
                torch.cuda.empty_cache()
                call, ref = case(2 if how == "round" else 3)
            else:
                ref()
            if how == "round":
                for i in range(2):
                    rec(when, f"round {i}", one_round(call))
            else:
                rec(when, how, timing.graph_times(call, range(LAYERS)).us)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timing_check.json").write_text(json.dumps(dict(env=gk.env_info(), rows=rows), indent=1, default=str))


if __name__ == "__main__":
    main()
