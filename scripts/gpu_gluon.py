"""The Gluon FP8 decode's tuning (ring depth, CTAs per SM) beside its backend defaults, on one GPU,
through the lab's one harness: each variant checked against the float64 oracle, then timed by
``labkit.timing`` (do_bench with L2 flushes, and CUDA-graph replays over rotating layers), percent of
copy bandwidth from ``labkit.roofline``'s ceilings measured in the same run.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_gluon.py --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402

from labkit import kvpool, reference, roofline, timing  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402
from labkit.kernels.mla_decode_fp8_ws import mla_decode_fp8_ws  # noqa: E402

VARIANTS = {"s2_c2": dict(num_stages=2, ctas_per_sm=2), "s2_c1": dict(num_stages=2, ctas_per_sm=1),
            "s3_c1": dict(num_stages=3, ctas_per_sm=1), "s4_c1": dict(num_stages=4, ctas_per_sm=1),
            "n64": dict(num_splits=64), "n128": dict(num_splits=128), "default": dict(),
            # the score MMA of each tile issued before the previous tile's softmax (pipeline=True), and not
            "pipe": dict(pipeline=True), "pipe_s3_c1": dict(pipeline=True, num_stages=3, ctas_per_sm=1),
            "pipe_s4_c1": dict(pipeline=True, num_stages=4, ctas_per_sm=1), "nopipe": dict(pipeline=False),
            # the warp-specialized 64-head kernel (mla_decode_fp8_ws): its 4-tile ring, a 3-tile one
            "ws": dict(kernel="ws"), "ws_s3": dict(kernel="ws", num_stages=3),
            # split partials in bf16 (half the bytes written and merged) and in fp32
            "p16": dict(part_dtype=torch.bfloat16), "ws_p16": dict(kernel="ws", part_dtype=torch.bfloat16),
            "p32": dict(part_dtype=torch.float32), "ws_p32": dict(kernel="ws", part_dtype=torch.float32),
            "n64_p16": dict(num_splits=64, part_dtype=torch.bfloat16),
            "n128_p16": dict(num_splits=128, part_dtype=torch.bfloat16),
            # sparse (--sparse): the warp-specialized kernel's rows by a producer warpgroup, 1 or 2 tiles
            # in flight beyond the one it waits for
            "ws_lag2": dict(kernel="ws", rows_lag=2),
            # 16-32 heads on two warpgroups (no spills: GPU_CONFIG_TWO_WG)
            "w8": dict(num_warps=8), "w4": dict(num_warps=4),
            "w8_s2_c2": dict(num_warps=8, num_stages=2, ctas_per_sm=2),
            # the pipelined tile loop on two warpgroups (no spills at 16-32 heads: sass_sm90.py --warps 8 --pipe)
            "pipe_w8": dict(pipeline=True, num_warps=8), "pipe_w8_s4": dict(pipeline=True, num_warps=8, num_stages=4),
            # sparse: the slots through the shared-memory ring (slot_ring=True) or by global loads in the chain
            "ring": dict(slot_ring=True), "noring": dict(slot_ring=False),
            "w8_noring": dict(num_warps=8, slot_ring=False),
}
SPARSE_SHAPES = [(16, 64, 32768, 2048), (32, 64, 32768, 2048), (64, 64, 32768, 2048), (128, 128, 32768, 2048),
                 (128, 64, 32768, 2048), (64, 1, 32768, 2048), (128, 1, 32768, 2048)]  # (heads, requests, context, topk)
SHAPES = [(16, 64, 8192), (8, 64, 8192), (16, 128, 8192), (16, 32, 32768), (32, 64, 8192), (16, 1, 8192),
          (64, 64, 8192), (128, 64, 8192), (64, 1, 8192), (128, 1, 8192)]  # (heads, requests, context)
# precision="accurate": the FP8 MMA accumulator's error grows with a split's length (labkit.mma_model);
# the default cap (ACCURATE_SPLIT_LEN) beside no cap and a shorter one, dense and sparse (top-2048 of 32K,
# page 1), and the fast precision on the same batch
ACC_VARIANTS = {"default": dict(), "nocap": dict(max_split_len=0), "len2048": dict(max_split_len=2048),
                "fast": dict(precision="fast"), "n64": dict(num_splits=64), "n128": dict(num_splits=128),
                "fast_n128": dict(precision="fast", num_splits=128), "n32": dict(num_splits=32),
                "pipe": dict(pipeline=True), "fast_pipe": dict(precision="fast", pipeline=True),
                "pipe_s3_c1": dict(pipeline=True, num_stages=3, ctas_per_sm=1),
                "bh32": dict(block_h=32), "bh64": dict(block_h=64), "fast_bh64": dict(precision="fast", block_h=64),
                "fast_nopipe": dict(precision="fast", pipeline=False),
                "fast_n32": dict(precision="fast", num_splits=32), "fast_n64": dict(precision="fast", num_splits=64),
                "ws": dict(kernel="ws"), "fast_ws": dict(kernel="ws", precision="fast"),
                "p16": dict(part_dtype=torch.bfloat16), "p32": dict(part_dtype=torch.float32),
                "w8": dict(num_warps=8), "fast_w8": dict(precision="fast", num_warps=8),
                "w4": dict(num_warps=4), "fast_w4": dict(precision="fast", num_warps=4),
                "w8_s2_c2": dict(num_warps=8, num_stages=2, ctas_per_sm=2),
                "pipe_w8": dict(pipeline=True, num_warps=8), "fast_pipe_w8": dict(precision="fast", pipeline=True, num_warps=8),
                "w4_ring": dict(num_warps=4, slot_ring=True), "noring": dict(slot_ring=False)}
# one request: at 64+ heads the default fills the SMs with splits of one tile or more (GPU_CONFIG_WIDE
# min_tiles=1: 128 splits at 64 heads, 66 at 128); n32 was the default before (>= 4 tiles a split)
ONE_REQUEST_ONLY = ("n32", "n64", "n128", "fast_n32", "fast_n64", "fast_n128", "n64_p16", "n128_p16")
ACC_SHAPES = [(16, 64, 8192, 0), (16, 32, 32768, 0), (32, 64, 8192, 0), (64, 64, 8192, 0), (128, 64, 8192, 0),
              (64, 1, 8192, 0), (128, 1, 8192, 0), (16, 64, 32768, 2048), (64, 64, 32768, 2048),
              (128, 128, 32768, 2048)]  # (heads, requests, context, topk)
LAYERS = 4  # rotating layers in the CUDA-graph timing
TOL = 6e-2  # FP8 query and FP8 probabilities
ACC_TOL = 3e-3  # precision="accurate"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, nargs="*", help="only the shapes with these head counts")
    ap.add_argument("--accurate", action="store_true", help="the precision='accurate' sweep (ACC_VARIANTS)")
    ap.add_argument("--sparse", action="store_true", help="the fast sweep on sparse shapes (SPARSE_SHAPES, page 1)")
    ap.add_argument("--variants", nargs="*", help="only these variants (names of VARIANTS or ACC_VARIANTS)")
    ap.add_argument("--kv-layout", default="fp8_per_tensor", choices=("fp8_per_tensor", "fp8_ds_mla"),
                    help="the rows' layout (fp8_ds_mla: sparse shapes only)")
    ap.add_argument("--hot", type=int, default=0, metavar="N",
                    help="dense: every request reads pages 0..N-1 only (page id mod N), so that the tiles come "
                         "from L2 and the timing is the kernel's own chain, not DRAM's")
    a = ap.parse_args()
    ds = a.kv_layout == "fp8_ds_mla"
    if ds and not (a.sparse or a.accurate):
        ap.error("--kv-layout fp8_ds_mla: the 656-byte rows are read for sparse batches only (--sparse or --accurate)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = roofline.measure_ceilings("cuda", cache_dir=out)
    res = dict(env=gk.env_info(), command=" ".join(sys.argv), copy_gbps=ceil.copy_gbps, rows=[])
    shapes = ACC_SHAPES if a.accurate else SPARSE_SHAPES if a.sparse else [(H, B, L, 0) for H, B, L in SHAPES]
    for H, B, L, topk in [s for s in shapes if (not a.heads or s[0] in a.heads) and (s[3] or not ds)]:
        page = 1 if topk else 64
        rows = int(B * L * 1.05) // 64 * 64 + 64
        pool = kvpool.random_pool(LAYERS, rows, page, device="cuda", seed=H + B, kv_layout=a.kv_layout)
        if topk:
            batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B)
        else:
            batch = kvpool.batch_for_pool(pool, [L] * B, seed=B)
            if a.hot:
                batch = dataclasses.replace(batch, kv_indices=batch.kv_indices % a.hot)
        qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
        ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
        idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
        base = dict(token_indices=batch.slots(0), kv_layout=a.kv_layout) if topk else {}
        if a.accurate:
            base["precision"] = "accurate"

        def launch(kw: dict):
            """The call of layer ``layer`` with the variant's keywords ``kw`` (``kernel``: which one)."""
            kw = dict(kw)
            fn = dict(ws=mla_decode_fp8_ws).get(kw.pop("kernel", None), mla_decode_fp8_gluon)
            return lambda layer: fn(qn, qp, pool.layer(layer), *idx, k_scale=1.0 if ds else pool.scale(layer),
                                    max_len=L if not topk else None, **kw)

        # whatever was timed first after a shape's reference ran up to 16% slow, both graph rounds
        # included (run 21, the same launch first and second: 8 heads 64 x 8K 135.2 / 117.8 us, 16 heads
        # 128 x 8K 257.9 / 222.5): a first timing of the default launch is made and dropped
        timing.graph_times(launch(base), range(LAYERS))
        for name, kw in (ACC_VARIANTS if a.accurate else VARIANTS).items():
            if (a.variants and name not in a.variants) or (B > 1 and name in ONE_REQUEST_ONLY):
                continue
            kw = {**base, **kw}
            call = launch(kw)
            row = dict(variant=name, H=H, B=B, L=L, topk=topk, precision=kw.get("precision", "fast"), hot=a.hot,
                       kv_layout=a.kv_layout)
            try:
                row["rel_err"] = reference.rel_err(call(0), ref)
                row["us"] = timing.bench(lambda: call(0)).us
                row["graph_us"] = timing.graph_times(call, range(LAYERS)).us
                row["pct_copy_graph"] = roofline.achieved("fp8_native", row["graph_us"] / 1e3, ceil, pool_tokens=0,
                                                          tokens_read=B * (topk or L), heads=H,
                                                          batch=B, kv_layout=a.kv_layout)["pct_bandwidth"]
                row["ok"] = row["rel_err"] < (ACC_TOL if row["precision"] == "accurate" else TOL)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["rows"].append(row)
            gk.log(json.dumps(row))
        fname = "gpu_gluon_accurate" if a.accurate else "gpu_gluon_sparse" if a.sparse else "gpu_gluon"
        (out / (fname + ("_ds" if ds else "") + ".json")).write_text(
            json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
