#!/usr/bin/env python3
"""One kernel launched a few times at one shape, for Nsight Compute to profile: where the Gluon
decode, the indexer's logits and its top-k spend their time (stall reasons per SASS instruction),
which CUDA events cannot say. Each case warms up (compiles) first, then launches ``--launches``
times; profile the last one:

    ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 \\
        --set full --import-source no -o OUT/gluon64 python3 scripts/ncu_cases.py gluon64
    ncu -i OUT/gluon64.ncu-rep --page source --print-source sass --csv > OUT/gluon64_sass.csv
    python3 scripts/ncu_cases.py --stalls OUT/gluon64_sass.csv > OUT/gluon64_stalls.txt   # any machine

Cases (CASES): the Gluon decode dense 64 x 8K at 16 and 64 heads (fast, and accurate at 16), sparse
top-2048 of 32K at 16 and 64 heads (per-tensor and fp8_ds_mla rows) and 128 heads; the logits and the top-k at 64 x 32K (GLM-5's indexer),
the CUDA top-k at 64 x 32K and 1 x 32K. ``--stalls``
sums a source page's warp-stall samples: the share of each reason, then the instructions that hold
the most samples.
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)
import gpu_topk  # noqa: E402

import torch  # noqa: E402

from labkit import config, kvpool  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402
from labkit.kernels.mla_decode_fp8_ws import mla_decode_fp8_ws  # noqa: E402


def gluon_case(H: int, B: int, L: int, topk: int = 0, ws: bool = False, kv_layout: str = "fp8_per_tensor", **kw):
    page = 1 if topk else 64
    pool = kvpool.random_pool(1, int(B * max(L, topk) * 1.05) // 64 * 64 + 64, page, device="cuda", seed=H,
                              kv_layout=kv_layout)
    batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B) if topk else \
        kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    if topk:
        kw["token_indices"] = batch.slots(0)
    fn = mla_decode_fp8_ws if ws else mla_decode_fp8_gluon
    if kv_layout != "fp8_per_tensor":
        kw["kv_layout"] = kv_layout
    k_scale = 1.0 if kv_layout == "fp8_ds_mla" else pool.scale(0)  # ds rows carry their own scales
    return lambda: fn(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                      gk.SM_SCALE, k_scale=k_scale, max_len=L, **kw)


def indexer_case(part: str, B: int = 64, ctx: int = 32768, **kw):
    case = gpu_topk.Case(config.load_model("glm5"), B, ctx, layers=1, device="cuda")
    if part == "logits":
        return lambda: case.index(0)
    return lambda: case.select_slots(case.logits[0], **kw)


CASES = {
    "gluon16": lambda: gluon_case(16, 64, 8192),
    "gluon16_acc": lambda: gluon_case(16, 64, 8192, precision="accurate"),
    "gluon64": lambda: gluon_case(64, 64, 8192),
    "gluon64_sparse": lambda: gluon_case(64, 64, 32768, topk=2048),
    "gluon16_sparse": lambda: gluon_case(16, 64, 32768, topk=2048),
    "gluon16_sparse_ring": lambda: gluon_case(16, 64, 32768, topk=2048, slot_ring=True),
    "gluon64_sparse_ds": lambda: gluon_case(64, 64, 32768, topk=2048, kv_layout="fp8_ds_mla"),
    "gluon128_sparse": lambda: gluon_case(128, 128, 32768, topk=2048),
    "ws64": lambda: gluon_case(64, 64, 8192, ws=True),  # the warp-specialized kernel (mla_decode_fp8_ws)
    "ws64_1": lambda: gluon_case(64, 1, 8192, ws=True),
    "logits": lambda: indexer_case("logits"),
    "topk": lambda: indexer_case("topk"),
    "topk_cuda": lambda: indexer_case("topk", impl="cuda"),  # labkit.kernels.topk_cuda (kernel topk_radix_cuda)
    "topk_cuda_1": lambda: indexer_case("topk", B=1, impl="cuda"),
}


def stall_summary(path: str, top: int = 25) -> str:
    """A ``--page source --csv`` export of Nsight Compute: every stall reason's share of the warp
    samples, then the ``top`` instructions by samples with their three largest reasons."""
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    total, per = collections.Counter(), []
    for r in data:
        d = {h: int(r[col[h]] or 0) for h in reasons}
        total.update(d)
        per.append((int(r[col["Warp Stall Sampling (All Samples)"]] or 0), r[col["Address"]][-5:],
                    r[col["Source"]].strip(), d))
    n = max(sum(s for s, *_ in per), 1)
    out = [f"samples {n}"] + [f"  {k:28s} {v / n * 100:5.1f}%" for k, v in total.most_common(12)]
    for s, addr, src, d in sorted(per, key=lambda x: -x[0])[:top]:
        why = ", ".join(f"{k[6:]}:{v}" for k, v in sorted(d.items(), key=lambda x: -x[1])[:3] if v)
        out.append(f"{s / n * 100:5.1f}% {addr} {src[:60]:60s} {why}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", nargs="?", choices=sorted(CASES))
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--stalls", metavar="CSV", help="summarize an exported source page instead")
    a = ap.parse_args()
    if a.stalls:
        print(stall_summary(a.stalls))
        return
    if a.case is None:
        ap.error(f"name a case: {sorted(CASES)}")
    fn = CASES[a.case]()
    for _ in range(a.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{a.case}: {a.launches} launches")


if __name__ == "__main__":
    main()
