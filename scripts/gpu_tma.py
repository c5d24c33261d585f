"""The TMA-fed FP8 decode (kernels/mla_decode_fp8_tma.py) against the pointer-gather FP8 kernel and
the BF16-pool kernel, side by side on one GPU: oracle check per variant (NaN-poisoned outputs and
NaN bytes past each request's end), then two timings per variant and shape:

* ``us``: ``triton.testing.do_bench`` median of whole calls (L2 flushed between calls), as
  ``gpu_kernels.py`` times every kernel;
* ``graph_us``: the same call captured in a CUDA graph and replayed (``do_bench_cudagraph``),
  which removes host launch work (descriptor creation, Python) from the figure.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_tma.py --out DIR
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402
import triton  # noqa: E402

from labkit import kvpool, reference  # noqa: E402

VARIANTS = {  # name -> (kernel, kwargs): the BF16-pool and pointer-gather baselines, then TMA variants
    "bf16.pipe32": ("bf16", dict(block_n=32, num_warps=4, num_stages=3)),
    "fp8.default": ("gather", dict()),
    "tma.w4_s4_h2_pv0": ("tma", dict(num_warps=4, num_stages=4, halves=2, pv_swap=0)),
    "tma.w4_s4_h1_pv1": ("tma", dict(num_warps=4, num_stages=4, halves=1, pv_swap=1)),
    "tma.w4_s2_h2_pv0_c1": ("tma", dict(num_warps=4, num_stages=2, halves=2, pv_swap=0, ctas_per_sm=1)),
    "tma.w4_s2_h1_pv1_c2": ("tma", dict(num_warps=4, num_stages=2, halves=1, pv_swap=1, ctas_per_sm=2)),
    "tma.w8_s2_h2_pv0_c2": ("tma", dict(num_warps=8, num_stages=2, halves=2, pv_swap=0, ctas_per_sm=2)),
    "tma.w4_s3_h2_pv0": ("tma", dict(num_warps=4, num_stages=3, halves=2, pv_swap=0)),
    "tma.default": ("tma", dict()),
}
SHAPES = [(8, 64, 8192), (16, 64, 8192), (16, 32, 32768), (8, 128, 16384), (32, 64, 8192), (16, 64, 8192)]
CHECKS = [(16, 64), (8, 64)]  # (heads, page_size) of the oracle checks
STEM = "gpu_tma"  # output file names


def call(kind, kw, qn, qp, pool8, pool16, batch, **extra):
    args = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    if kind == "bf16":
        return gk.mla_decode(qn, qp, pool16.layer(0), *args, **kw, **extra)
    fn = dict(tma=gk.mla_decode_fp8_tma, gluon=gk.mla_decode_fp8_gluon).get(kind, gk.mla_decode_fp8)
    return fn(qn, qp, pool8.layer(0), *args, pool8.scale(0), **kw, **extra)


def check(name, kind, kw, H, page_size=64):
    lens = [1, 63, 64, 65, 1000, 4097]
    pool = kvpool.random_pool(1, (sum(lens) + 8 * page_size) * 2, page_size, device=gk.DEV, seed=H)
    pool16 = kvpool.random_pool(1, (sum(lens) + 8 * page_size) * 2, page_size, kv_dtype="bf16", device=gk.DEV, seed=H)
    batch = kvpool.make_batch(pool.num_pages, page_size, lens, seed=H, device=gk.DEV)
    qn, qp = kvpool.make_queries(len(lens), H, device=gk.DEV, seed=H)
    src = pool16 if kind == "bf16" else pool
    ref = reference.mla_decode(qn, qp, src.dequant(0, torch.float64) if kind != "bf16" else src.layer(0).double(),
                               batch, gk.SM_SCALE)
    if kind != "bf16":  # stale NaN bytes past each request's end, in its last page
        raw = pool.layer(0).view(torch.uint8)
        for b, n in enumerate(lens):
            raw[int(batch.kv_indices[int(batch.kv_indptr[b + 1]) - 1]), (n - 1) % page_size + 1:] = 0x7F
    errs = []
    for ns in (None, 1):
        with gk.poisoned_empty():
            out = call(kind, kw, qn, qp, pool, pool16, batch, num_splits=ns)
        gk.sync()
        errs.append(reference.rel_err(out, ref) if torch.isfinite(out).all() else float("inf"))
    err = max(errs)
    return err, err < (gk.TOL_BF16 if kind == "bf16" else gk.TOL_Q8)


def _compile(job):
    """Compile one (variant, head count) in both split modes into Triton's disk cache."""
    name, H = job
    kind, kw = VARIANTS[name]
    try:
        pool = kvpool.random_pool(1, 8192, 64, device="cuda")
        pool16 = kvpool.random_pool(1, 8192, 64, kv_dtype="bf16", device="cuda")
        batch = kvpool.make_batch(pool.num_pages, 64, [1024, 100], device="cuda")
        qn, qp = kvpool.make_queries(2, H, device="cuda")
        for ns in (1, 3):
            call(kind, kw, qn, qp, pool, pool16, batch, num_splits=ns)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def precompile(workers=14):
    import concurrent.futures as cf
    import multiprocessing

    jobs = [(n, H) for n in VARIANTS for H in sorted({h for h, _, _ in SHAPES})]
    t = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        ok = list(ex.map(_compile, jobs))
    gk.log(f"precompiled {sum(ok)}/{len(jobs)} in {time.time() - t:.0f} s; failed {[j for j, o in zip(jobs, ok) if not o]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the interpreter (code paths only)")
    opts = ap.parse_args()
    global SHAPES
    if opts.cpu_smoke:
        gk.DEV, SHAPES = "cpu", [(16, 2, 256)]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(env=gk.env_info(), command=" ".join(sys.argv), ceilings={}, checks={}, rows=[])
    if gk.DEV == "cuda":
        precompile()
    gk.ceilings(res["ceilings"])
    for name, (kind, kw) in VARIANTS.items():
        for H, ps in CHECKS[: 1 if gk.DEV == "cpu" else None]:
            try:
                err, ok = check(name, kind, kw, H, ps)
            except Exception as e:  # noqa: BLE001
                err, ok = f"{type(e).__name__}: {str(e)[:200]}", False
            key = f"{name}/h{H}" + ("" if ps == 64 else f"/ps{ps}")
            res["checks"][key] = dict(err=err, ok=ok)
            gk.log(f"check {name:24s} h{H:<3d} ps{ps:<4d} {'OK  ' if ok else 'FAIL'} {err}")
    max_pages = max(B * L // 64 for _, B, L in SHAPES)
    pool8 = kvpool.random_pool(1, int(max_pages * 1.1) * 64, 64, device=gk.DEV, seed=1)
    pool16 = kvpool.random_pool(1, int(max_pages * 1.1) * 64, 64, kv_dtype="bf16", device=gk.DEV, seed=1)
    copy = res["ceilings"]["copy_bw_TBps"]
    for i, (H, B, L) in enumerate(SHAPES):
        batch = kvpool.make_batch(pool8.num_pages, 64, [L] * B, seed=H + B + i, device=gk.DEV)
        qn, qp = kvpool.make_queries(B, H, device=gk.DEV, seed=B)
        for name, (kind, kw) in VARIANTS.items():
            fn = lambda: call(kind, kw, qn, qp, pool8, pool16, batch, max_len=L)  # noqa: E731
            row = dict(variant=name, shape=f"h{H} {B}x{L // 1024}K", H=H, B=B, L=L, order=i)
            try:
                row["us"] = gk.bench_us(fn)
                if gk.DEV == "cuda":
                    with torch.cuda.stream(torch.cuda.Stream()):
                        row["graph_us"] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                else:
                    row["graph_us"] = row["us"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            kv_bytes = B * L * (1152 if kind == "bf16" else 576)
            for k in ("us", "graph_us"):
                if k in row:
                    row[f"pct_copy_{k}"] = 100 * kv_bytes / row[k] / 1e6 / copy
            row["checked"] = all(v["ok"] for k, v in res["checks"].items() if k.startswith(name + "/"))
            res["rows"].append(row)
            gk.log(f"{row['shape']:13s} {name:24s} " + (f"{row['us']:7.1f} us ({row['pct_copy_us']:4.1f}%)  graph "
                   f"{row['graph_us']:7.1f} us ({row['pct_copy_graph_us']:4.1f}%)" if "graph_us" in row
                   else row.get("error", "")))
        for r in res["rows"]:
            if r["order"] == i and "us" in r:
                base = next((x["us"] for x in res["rows"] if x["order"] == i and x["variant"] == "bf16.pipe32"
                             and "us" in x), None)
                r["x_bf16"] = base / r["us"] if base else None
        (out / f"{STEM}.json").write_text(json.dumps(res, indent=1, default=str))
    keys = ["variant", "shape", "H", "B", "L", "order", "us", "graph_us", "pct_copy_us", "pct_copy_graph_us",
            "x_bf16", "checked", "error"]
    with open(out / f"{STEM}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(res["rows"])
    gk.log(f"wrote {out}/{STEM}.json and .csv ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
