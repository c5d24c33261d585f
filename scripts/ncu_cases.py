#!/usr/bin/env python3
"""One kernel launched a few times at one shape, for Nsight Compute to profile: where the Gluon
decode, the indexer's logits and its top-k spend their time (stall reasons per SASS instruction),
which CUDA events cannot say. Each case warms up (compiles) first, then launches ``--launches``
times; profile the last one:

    ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 \\
        --set full --import-source no -o OUT/gluon64 python3 scripts/ncu_cases.py gluon64
    ncu -i OUT/gluon64.ncu-rep --page source --print-source sass --csv > OUT/gluon64_sass.csv

Cases (CASES): the Gluon decode dense 64 x 8K at 16 and 64 heads (fast, and accurate at 16), sparse
top-2048 of 32K at 64 heads; the logits and the top-k at 64 x 32K (GLM-5's indexer).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)
import gpu_topk  # noqa: E402

import torch  # noqa: E402

from labkit import config, kvpool  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402


def gluon_case(H: int, B: int, L: int, topk: int = 0, **kw):
    page = 1 if topk else 64
    pool = kvpool.random_pool(1, int(B * max(L, topk) * 1.05) // 64 * 64 + 64, page, device="cuda", seed=H)
    batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B) if topk else \
        kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    if topk:
        kw["token_indices"] = batch.slots(0)
    return lambda: mla_decode_fp8_gluon(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                                        gk.SM_SCALE, k_scale=pool.scale(0), max_len=L, **kw)


def indexer_case(part: str, B: int = 64, ctx: int = 32768):
    case = gpu_topk.Case(config.load_model("glm5"), B, ctx, layers=1, device="cuda")
    if part == "logits":
        return lambda: case.index(0)
    return lambda: case.triton_topk(case.logits[0])


CASES = {
    "gluon16": lambda: gluon_case(16, 64, 8192),
    "gluon16_acc": lambda: gluon_case(16, 64, 8192, precision="accurate"),
    "gluon64": lambda: gluon_case(64, 64, 8192),
    "gluon64_sparse": lambda: gluon_case(64, 64, 32768, topk=2048),
    "logits": lambda: indexer_case("logits"),
    "topk": lambda: indexer_case("topk"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--launches", type=int, default=3)
    a = ap.parse_args()
    fn = CASES[a.case]()
    for _ in range(a.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{a.case}: {a.launches} launches")


if __name__ == "__main__":
    main()
