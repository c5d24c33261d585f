#!/usr/bin/env python3
"""The parts of the indexer's logits + top-k with the candidates from the logits kernel
(labkit.indexer.logits_with_candidates, slots_from_candidates), each timed alone by CUDA-graph
replays over 4 rotating layers (labkit.timing.graph_times), beside the plain logits kernel:
sampled logits and threshold (apart, and in one launch as logits_with_candidates makes them:
kernels/index_sample.py), logits with candidates, the fallback check, the select over the
candidates (in registers, regs=4096, and by passes over memory as slots_from_candidates does it), and the
first three together. One line of figures per shape (us a layer) and the
first requests' candidate counts.

    PYTHONPATH=$PWD python3 scripts/gpu_cand_parts.py [--shapes 64x32768] [--sample 1024] [--runs 1 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpu_topk  # noqa: E402
from labkit import config, timing  # noqa: E402
from labkit.indexer import logits_with_candidates, sample_table  # noqa: E402
from labkit.kernels.index_logits import index_logits  # noqa: E402
from labkit.kernels.index_sample import index_sample_threshold  # noqa: E402
from labkit.kernels.topk_prefilter import finish_candidates, sample_threshold  # noqa: E402
from labkit.kernels.topk_select import topk_select  # noqa: E402

LAYERS = 4


def parts(c: gpu_topk.Case, sample: int, run: int) -> dict:
    """The row of one shape (``c``: gpu_topk's case) at one sample size and run length."""
    b, topk, t = c.batch, c.topk, sample_table(c.batch, sample, run)
    B, ctx = b.batch_size, b.max_len
    us = lambda fn: timing.graph_times(fn, range(LAYERS), replays=20, warmup=2).us  # noqa: E731
    args = lambda i: (c.q_idx[i], c.weights[i], c.cache.k_idx(i), c.cache.k_scale(i))  # noqa: E731

    def sampled(i):
        return index_logits(*args(i), t.kv_indptr, t.kv_indices, t.kv_lens, 1, sample)

    S = [sampled(i) for i in range(LAYERS)]
    th = [sample_threshold(S[i], b.kv_lens, topk) for i in range(LAYERS)]

    def with_cand(i):
        t16, cnt = th[i]
        cnt.zero_()  # a memset in the graph, as the threshold kernel does it
        cr = torch.empty(B, ctx, device="cuda")
        cs = torch.empty(B, ctx, dtype=torch.int32, device="cuda")
        return index_logits(*args(i), b.kv_indptr, b.kv_indices, b.kv_lens, b.page_size, ctx,
                            candidates=(t16, cr, cs, cnt))

    lc = [logits_with_candidates(c.q_idx[i], c.weights[i], c.cache, i, b, topk, t) for i in range(LAYERS)]
    fin = lambda i: finish_candidates(lc[i][0], b.kv_lens, b.kv_indptr, b.kv_indices, b.page_size, topk, *lc[i][1])  # noqa: E731
    F = [fin(i) for i in range(LAYERS)]
    row = dict(batch=B, context=ctx, sample=sample, run=run, counts=lc[0][1][2][:8].tolist())
    fused = lambda i: index_sample_threshold(*args(i), t.kv_indices, b.kv_lens, sample, topk)  # noqa: E731
    row.update(sampled_us=us(sampled), threshold_us=us(lambda i: sample_threshold(S[i], b.kv_lens, topk)),
               sampled_threshold_us=us(fused),
               logits_cand_us=us(with_cand), logits_us=us(c.index), finish_us=us(fin),
               select_us=us(lambda i: topk_select(F[i][0], F[i][2], F[i][3], F[i][1].view(-1), 1, topk, splits=1,
                                                  count="histogram", regs=4096)),
               select_passes_us=us(lambda i: topk_select(F[i][0], F[i][2], F[i][3], F[i][1].view(-1), 1, topk,
                                                         splits=1, count="histogram")),
               with_cand_us=us(lambda i: logits_with_candidates(c.q_idx[i], c.weights[i], c.cache, i, b, topk, t)))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["64x32768"])
    ap.add_argument("--sample", type=int, default=1024)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 64], help="sampled positions in runs of these lengths")
    a = ap.parse_args()
    cfg = config.load_model("glm5")
    print(torch.cuda.get_device_name(), torch.__version__)
    for s in a.shapes:
        B, ctx = (int(v) for v in s.split("x"))
        case = gpu_topk.Case(cfg, B, ctx, LAYERS, "cuda")
        for run in a.runs:
            r = parts(case, a.sample, run)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
