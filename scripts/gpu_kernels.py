#!/usr/bin/env python3
"""The lab's Triton kernels on one GPU, in one run: correctness, ceilings, timings side by side.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_kernels.py [--quick]
        [--only REGEX] [--out DIR] [--no-precompile]

(a) every kernel / variant against the fp64 oracle (labkit.reference) at a few shapes, outputs
    poisoned with NaN (torch.empty patched) so unwritten elements fail;
(b) the two ceilings measured in the same run: device-to-device copy (read + write counted) and an
    8192^3 bf16 matmul on random data;
(c) medians by triton.testing.do_bench of variants x shapes (page size 64, pages scattered, pools
    far larger than the 60 MB L2);
(d) a compact table last; JSON + CSV (GPU, driver, torch, triton, git revision) to $OUT or --out.
Runs from a plain checkout: the repo root goes on sys.path and ``labkit.kernels`` is aliased to
``kernels`` when the package is not installed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import csv
import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNEL_MODULES = ("mla_merge", "mla_decode", "launch", "mla_decode_fp8", "mla_decode_fp8_gluon", "fp8_to_bf16",
                  "gather_cast")


def alias_kernels():
    """``labkit.kernels`` is ``kernels/`` through the installed package; alias it in a plain checkout."""
    import labkit

    try:
        importlib.import_module("labkit.kernels.mla_decode")
        return
    except ModuleNotFoundError:
        pass
    pkg = importlib.import_module("kernels")
    sys.modules["labkit.kernels"] = pkg
    labkit.kernels = pkg
    for m in KERNEL_MODULES:
        sys.modules[f"labkit.kernels.{m}"] = importlib.import_module(f"kernels.{m}")


alias_kernels()

import torch  # noqa: E402
import triton  # noqa: E402

from labkit import backends, kvpool, reference, roofline, timing  # noqa: E402
from labkit.kernels.ds_mla_to_bf16 import ds_mla_to_bf16  # noqa: E402
from labkit.kernels.fp8_to_bf16 import fp8_to_bf16  # noqa: E402
from labkit.kernels.gather_cast import gather_cast  # noqa: E402
from labkit.kernels.mla_decode import mla_decode  # noqa: E402
from labkit.kernels.mla_decode_fp8 import mla_decode_fp8  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402


def fp8_call(*args, **kw):
    return mla_decode_fp8(*args, **kw)

DEV = "cuda"
CEIL = None  # labkit.roofline.Ceilings measured by ceilings(): the one roofline computation
PAGE = 64
SM_SCALE = 1 / 16  # GLM-5: 1/sqrt(192 + 64)

# ---------------------------------------------------------------------------------------------
# Variants: name -> kwargs of mla_decode_fp8 (FP8 pool) or mla_decode (BF16 pool).
# ---------------------------------------------------------------------------------------------
FP8_SMALL_H = {  # 8 / 16 heads: memory-bound ("asm": the fp16 widening by inline PTX, the only one left)
    "fp8.asm_pipe64": dict(q_fp8=False, swap=0, block_n=64, num_warps=4, num_stages=3),
    "fp8.asm_pipe32": dict(q_fp8=False, swap=0, block_n=32, num_warps=4, num_stages=3),
    "fp8.asm_pipe32_s2": dict(q_fp8=False, swap=0, block_n=32, num_warps=4, num_stages=2),
    "fp8.asm_pipe32_swap1": dict(q_fp8=False, swap=1, block_n=32, num_warps=4, num_stages=3),
    "fp8.asm_pipe32_swap1_s2": dict(q_fp8=False, swap=1, block_n=32, num_warps=4, num_stages=2),
    # one shared-memory buffer, small enough for 2 CTAs/SM (docs/perf-notes.md, v5; measured in run 2)
    "fp8.q8_pipe64_swap1_s1": dict(q_fp8=True, swap=1, block_n=64, num_warps=4, num_stages=1),
    "fp8.asm_pipe64_swap1_s1": dict(q_fp8=False, swap=1, block_n=64, num_warps=4, num_stages=1),
    "fp8.q8_pipe64_swap1": dict(q_fp8=True, swap=1, block_n=64, num_warps=4, num_stages=3),
    "fp8.q8_pipe32_swap1": dict(q_fp8=True, swap=1, block_n=32, num_warps=4, num_stages=3),
    "fp8.q8_pipe128_swap1_w8": dict(q_fp8=True, swap=1, block_n=128, num_warps=8, num_stages=2),
}
FP8_LARGE_H = {  # 64 / 128 heads (BLOCK_H 64, 8 warps): compute-bound
    "fp8.asm_pipe32": dict(q_fp8=False, swap=0, block_n=32, num_warps=8, num_stages=2),
    "fp8.asm_pipe64": dict(q_fp8=False, swap=0, block_n=64, num_warps=8, num_stages=2),
    "fp8.q8_pipe32": dict(q_fp8=True, swap=0, block_n=32, num_warps=8, num_stages=2),
    "fp8.q8_pipe64": dict(q_fp8=True, swap=0, block_n=64, num_warps=8, num_stages=2),
    "fp8.default": dict(),
}
FP8_SMALL_H["fp8.default"] = dict()  # GPU_DEFAULTS in kernels/mla_decode_fp8.py (an FP8 query)
BF16_SMALL_H = {
    "bf16.pipe64": dict(block_n=64, num_warps=4, num_stages=3),
    "bf16.pipe32": dict(block_n=32, num_warps=4, num_stages=3),
    "bf16.pipe64_w8": dict(block_n=64, num_warps=8, num_stages=3),
}
BF16_LARGE_H = {
    "bf16.pipe32": dict(block_n=32, num_warps=8, num_stages=2),
    "bf16.pipe64": dict(block_n=64, num_warps=8, num_stages=2),
}

SHAPES = [  # (heads, batch, context)
    (16, 64, 8192), (16, 32, 32768), (8, 64, 8192), (8, 128, 16384), (128, 64, 8192), (64, 64, 8192),
]
QUICK_SHAPES = [(16, 64, 8192), (128, 64, 8192)]


def fp8_variants(H):
    return FP8_SMALL_H if H <= 32 else FP8_LARGE_H


def bf16_variants(H):
    return BF16_SMALL_H if H <= 32 else BF16_LARGE_H


# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def poisoned_empty():
    """Every floating torch.empty inside is NaN-filled: an unwritten output element shows."""
    real = torch.empty

    def nan_empty(*a, **k):
        t = real(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = real


def bench_us(fn, warmup=10, rep=50) -> float:
    """labkit.timing.bench's median (do_bench with L2 flushes on a GPU; --cpu-smoke: the code paths)."""
    return timing.bench(fn, warmup_ms=warmup if DEV == "cuda" else 0, rep_ms=rep if DEV == "cuda" else 0,
                        device=DEV, min_reps=1).us


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
def ceilings(res):
    """The two ceilings as labkit.roofline measures them (one roofline computation for the lab)."""
    c = roofline.measure_ceilings(DEV, copy_bytes=None if DEV == "cuda" else 1 << 20,
                                  matmul_n=None if DEV == "cuda" else 256)
    global CEIL
    CEIL = c
    res["copy_bw_TBps"], res["bf16_matmul_TFLOPs"] = c.copy_gbps / 1e3, c.matmul_tflops
    empty_cache()
    log(f"ceilings: copy {res['copy_bw_TBps']:.2f} TB/s, bf16 matmul {res['bf16_matmul_TFLOPs']:.0f} TFLOP/s")


# ---------------------------------------------------------------------------------------------
TOL_BF16 = 1e-2  # bf16 operands and a bf16 output on the GPU
TOL_Q8 = 6e-2  # q quantized to e4m3: the study saw 2.8-3.2e-2
TOL_LSE = 1e-2  # absolute, natural log
TOL_LSE_Q8 = 2e-1


CHECK_CASES = [  # (page_size, heads, lens, every variant or a few)
    (64, 16, [1, 63, 64, 65, 1000, 4097], True),
    (1, 8, [1, 2, 37, 700], False),
    (128, 128, [1, 127, 128, 129, 3000], True),
    (16, 64, [5, 16, 17, 2048], False),
    (128, 8, [1, 127, 128, 129, 3000], False),
]
FEW = ("fp8.default", "fp8.q8_pipe64_swap1", "fp8.q8_pipe32")


def checked_variants(H, every, ps=PAGE):
    return {k: v for k, v in fp8_variants(H).items() if every or k in FEW}


def correctness(results, only):
    """Every kernel/variant against the oracle; poisoned outputs; fresh random inputs per case."""
    cases = CHECK_CASES
    if DEV == "cpu":
        cases = [(64, 16, [1, 63, 64, 65, 200], True), (1, 8, [1, 2, 37], False)]
    for ci, (ps, H, lens, every) in enumerate(cases):
        seed = 100 + ci
        ptoks = (sum(lens) + len(lens) * ps) * 2
        pool, src = kvpool.random_pool(1, ptoks, ps, device=DEV, seed=seed, return_source=True)
        pool16 = kvpool.random_pool(1, ptoks, ps, kv_dtype="bf16", device=DEV, seed=seed)
        batch = kvpool.make_batch(pool.num_pages, ps, lens, seed=seed, device=DEV)
        qn, qp = kvpool.make_queries(len(lens), H, device=DEV, seed=seed)
        ref8, lse8 = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM_SCALE, return_lse=True)
        refsrc = reference.mla_decode(qn, qp, src[0].double(), batch, SM_SCALE)
        ref16, lse16 = reference.mla_decode(qn, qp, pool16.layer(0).double(), batch, SM_SCALE, return_lse=True)
        shape = f"ps{ps}/h{H}/{len(lens)}req"
        args = (batch.kv_indptr, batch.kv_indices, batch.kv_lens)

        def check(name, fn, ref, lse_ref, tol, tol_lse, src_ref=None):
            if only and not re.search(only, name):
                return
            row = dict(kernel=name, shape=shape)
            try:
                with poisoned_empty():
                    out, lse = fn()
                sync()
                row["rel_err"] = reference.rel_err(out, ref)
                row["lse_err"] = float((lse.double() - lse_ref).abs().max())
                if src_ref is not None:
                    row["rel_err_vs_source"] = reference.rel_err(out, src_ref)
                row["ok"] = bool(row["rel_err"] < tol and row["lse_err"] < tol_lse)
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            results["correctness"].append(row)
            log(f"  check {name:28s} {shape:18s} " + ("OK  " if row.get("ok") else "FAIL") +
                f" rel={row.get('rel_err', float('nan')):.2e} lse={row.get('lse_err', float('nan')):.1e}"
                + (f" {row['error']}" if "error" in row else ""))

        check("mla_decode(bf16 pool)", lambda: mla_decode(qn, qp, pool16.layer(0), *args, SM_SCALE, return_lse=True),
              ref16, lse16, TOL_BF16, TOL_LSE)
        check("mla_decode(bf16, splits=3)", lambda: mla_decode(qn, qp, pool16.layer(0), *args, SM_SCALE,
                                                               num_splits=3, return_lse=True), ref16, lse16,
              TOL_BF16, TOL_LSE)
        for vname, kw in checked_variants(H, every, ps).items():
            q8 = kw.get("q_fp8", True)  # the default is an FP8 query
            for ns in (None, 1):
                check(f"{vname}{'' if ns is None else '/s1'}",
                      lambda kw=kw, ns=ns: fp8_call(qn, qp, pool.layer(0), *args, SM_SCALE, pool.scale(0),
                                                    num_splits=ns, return_lse=True, **kw),
                      ref8, lse8, TOL_Q8 if q8 else TOL_BF16, TOL_LSE_Q8 if q8 else TOL_LSE, refsrc)
        # the refusal: 16-bit kernel given FP8 pages
        try:
            mla_decode(qn, qp, pool.layer(0), *args, SM_SCALE)
            results["correctness"].append(dict(kernel="mla_decode refuses fp8", shape=shape, ok=False))
        except ValueError as e:
            results["correctness"].append(dict(kernel="mla_decode refuses fp8", shape=shape, ok=True, error=str(e)[:120]))
        # casts: exact
        for name, fn, want in (
                ("fp8_to_bf16", lambda: fp8_to_bf16(pool.layer(0)), lambda: pool.layer(0).to(torch.bfloat16)),
                ("gather_cast", lambda: gather_cast(pool.layer(0), batch.kv_indices),
                 lambda: pool.layer(0)[batch.kv_indices.long()].to(torch.bfloat16))):
            try:
                with poisoned_empty():
                    got = fn()
                ok, err = bool(torch.equal(got, want())), ""
            except Exception as e:  # noqa: BLE001
                ok, err = False, f"{type(e).__name__}: {str(e)[:200]}"
            results["correctness"].append(dict(kernel=name, shape=shape, ok=ok, **({"error": err} if err else {})))
            log(f"  check {name:28s} {shape:18s} {'OK  ' if ok else 'FAIL'} exact {err}")
        # backends through the registry
        for bname in ("full_pool_cast.triton", "full_pool_cast.seed", "gather_cast.triton", "fp8_native.triton",
                      "fp8_native.triton_q8"):
            check(bname, lambda bname=bname: (backends.get(bname).decode(qn, qp, pool, 0, batch, SM_SCALE),
                                              lse8.float()), ref8, lse8, TOL_Q8 if bname.endswith("q8") else TOL_BF16,
                  1.0)
        check("bf16_pool.triton", lambda: (backends.get("bf16_pool.triton").decode(qn, qp, pool16, 0, batch, SM_SCALE),
                                           lse16.float()), ref16, lse16, TOL_BF16, 1.0)
        del pool, pool16, src
        empty_cache()


# ---------------------------------------------------------------------------------------------
def precompile(shapes, only, workers, timeout_s=180):
    """Compile every (variant, head count, split mode) in parallel processes into Triton's disk
    cache, so the timing loop loads them instead of compiling one after another."""
    jobs = []
    for H in sorted({s[0] for s in shapes}):
        for name, kw in fp8_variants(H).items():
            if not only or re.search(only, name):
                jobs.append(("fp8", H, PAGE, kw))
        for name, kw in bf16_variants(H).items():
            if not only or re.search(only, name):
                jobs.append(("bf16", H, PAGE, kw))
    for ps, H, _, every in CHECK_CASES:
        jobs.append(("bf16", H, ps, {}))
        for name, kw in checked_variants(H, every, ps).items():
            if ps != PAGE and (not only or re.search(only, name)):
                jobs.append(("fp8", H, ps, kw))
    t = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futs = [ex.submit(_compile_job, j) for j in jobs]
    done, pending = cf.wait(futs, timeout=timeout_s)
    failed = [j for f, j in zip(futs, jobs) if f in done and not f.result()]
    ex.shutdown(wait=False, cancel_futures=True)
    log(f"precompiled {len(done)}/{len(jobs)} jobs (x 2 split modes) in {time.time() - t:.0f} s; "
        f"{len(failed)} failed: {[(k, h, p) for k, h, p, _ in failed][:6]}; {len(pending)} unfinished")


def _compile_job(job):
    kind, H, ps, kw = job
    try:
        pool = kvpool.random_pool(1, 4096, ps, kv_dtype="fp8_e4m3" if kind == "fp8" else "bf16", device=DEV)
        batch = kvpool.make_batch(pool.num_pages, ps, [1024, 100], device=DEV)
        qn, qp = kvpool.make_queries(2, H, device=DEV)
        args = (qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM_SCALE)
        for ns in (1, 3):
            if kind == "fp8":
                fp8_call(*args, 1.0, num_splits=ns, **kw)
            else:
                mla_decode(*args, num_splits=ns, **kw)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------------
def timings(results, shapes, only, ceil):
    max_pages = max(B * -(-L // PAGE) for _, B, L in shapes)
    pool_tokens = (int(max_pages * 1.15) + 1) * PAGE
    log(f"pools: {pool_tokens} tokens x 576 (fp8 {pool_tokens * 576 / 2**30:.2f} GiB, bf16 x2)")
    pool8 = kvpool.random_pool(1, pool_tokens, PAGE, device=DEV, seed=1)
    pool16 = kvpool.random_pool(1, pool_tokens, PAGE, kv_dtype="bf16", device=DEV, seed=1)
    rows = results["timings"]
    checked_ok = {}
    for r in results["correctness"]:
        name = r["kernel"].split("/")[0]
        checked_ok[name] = checked_ok.get(name, True) and bool(r.get("ok"))
    for H, B, L in shapes:
        shape = f"h{H} {B}x{L // 1024}K"
        batch = kvpool.make_batch(pool8.num_pages, PAGE, [L] * B, seed=H + B, device=DEV)
        qn, qp = kvpool.make_queries(B, H, device=DEV, seed=B)
        tokens = B * L
        args = (batch.kv_indptr, batch.kv_indices, batch.kv_lens)

        def record(group, name, fn, kv_bytes, extra=None):
            if only and not re.search(only, name):
                return
            row = dict(group=group, variant=name, shape=shape, H=H, B=B, L=L)
            try:
                us = bench_us(fn)
                path = "fp8_native" if group in ("fp8_native", "splits") else ("bf16_pool" if kv_bytes == tokens * 1152
                                                                                else name.split(".")[0])
                ach = roofline.achieved(path, us / 1e3, CEIL, pool_tokens=pool8.pool_tokens, tokens_read=tokens,
                                        kv_dtype="bf16" if path == "bf16_pool" else "fp8_e4m3", heads=H, batch=B)
                row.update(us=us, kv_TBps=kv_bytes / us / 1e6, TFLOPs=ach["tflops"], pct_ceiling=ach["pct_roofline"])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row.update(extra or {})
            rows.append(row)
            log(f"  {shape:14s} {name:28s} " + (f"{row['us']:8.1f} us {row['kv_TBps']:5.2f} TB/s "
                                               f"{row['TFLOPs']:6.1f} TFLOP/s {row['pct_ceiling']:5.1f}%"
                                               if "us" in row else row["error"]))

        for name, kw in bf16_variants(H).items():
            record("bf16_pool", name, lambda kw=kw: mla_decode(qn, qp, pool16.layer(0), *args, SM_SCALE,
                                                               max_len=L, **kw), tokens * 1152)
        for name, kw in fp8_variants(H).items():
            record("fp8_native", name, lambda kw=kw: fp8_call(qn, qp, pool8.layer(0), *args, SM_SCALE,
                                                              pool8.scale(0), max_len=L, **kw), tokens * 576)
        # split counts for the two fastest FP8 variants that passed their checks, and the best BF16
        here = [r for r in rows if r["shape"] == shape and "us" in r]
        good8 = sorted((r for r in here if r["group"] == "fp8_native" and checked_ok.get(r["variant"], True)),
                       key=lambda r: r["us"])
        for r in good8[:2]:
            kw = fp8_variants(H)[r["variant"]]
            for ns in (1, 2, 4, 8, 16):
                record("splits", f"{r['variant']}/s{ns}", lambda kw=kw, ns=ns: fp8_call(
                    qn, qp, pool8.layer(0), *args, SM_SCALE, pool8.scale(0), num_splits=ns, max_len=L, **kw),
                    tokens * 576)
        best16 = sorted((r for r in here if r["group"] == "bf16_pool"), key=lambda r: r["us"])
        for r in best16[:1]:
            kw = bf16_variants(H)[r["variant"]]
            for ns in (1, 2, 4, 8, 16):
                record("bf16_pool", f"{r['variant']}/s{ns}", lambda kw=kw, ns=ns: mla_decode(
                    qn, qp, pool16.layer(0), *args, SM_SCALE, num_splits=ns, max_len=L, **kw), tokens * 1152)
        # the paths end to end (the whole-pool casts read the whole pool: pool_tokens)
        if (H in (16, 128) and B == 64) or DEV == "cpu":
            for bname in ("full_pool_cast.seed", "full_pool_cast.triton", "gather_cast.triton", "fp8_native.triton",
                          "fp8_native.triton_q8"):
                b = backends.get(bname)
                record("path", bname, lambda b=b: b.fn(qn, qp, pool8, 0, batch, SM_SCALE), tokens * 576)
            b = backends.get("bf16_pool.triton")
            record("path", "bf16_pool.triton", lambda: b.fn(qn, qp, pool16, 0, batch, SM_SCALE), tokens * 1152)
        # speedup against the best BF16-pool kernel at this shape
        same = [r for r in rows if r["shape"] == shape and "us" in r]
        best16 = min((r["us"] for r in same if r["group"] == "bf16_pool"), default=None)
        for r in same:
            r["speedup_vs_bf16_pool"] = best16 / r["us"] if best16 else None
    del pool8, pool16
    empty_cache()


def cast_timings(results, only, ceil):
    """fp8_to_bf16 on the seed's 495K-token layer against torch .to(); gather_cast for 8K and 512K tokens."""
    rows = results["timings"]
    n_tok = 495_000 // PAGE * PAGE if DEV == "cuda" else 4096
    layer = kvpool.random_pool(1, n_tok, PAGE, device=DEV).layer(0)
    nbytes = layer.numel() * 3

    def rec(name, fn, nb, shape):
        if only and not re.search(only, name):
            return
        row = dict(group="cast", variant=name, shape=shape)
        try:
            us = bench_us(fn)
            row.update(us=us, kv_TBps=nb / us / 1e6, pct_ceiling=CEIL.pct_copy(nb, us / 1e3))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(f"  {shape:14s} {name:28s} " + (f"{row['us']:8.1f} us {row['kv_TBps']:5.2f} TB/s (r+w) "
                                           f"{row['pct_ceiling']:5.1f}%" if "us" in row else row["error"]))

    rec("torch .to(bf16)", lambda: layer.to(torch.bfloat16), nbytes, "495K pool")
    for blk in (4096, 8192, 16384):
        for nw in (4, 8):
            rec(f"fp8_to_bf16 b{blk} w{nw}", lambda blk=blk, nw=nw: fp8_to_bf16(layer, block=blk, num_warps=nw),
                nbytes, "495K pool")
    for ntok in ((8192, 262144) if DEV == "cuda" else (256,)):  # the layer holds 495K tokens
        batch = kvpool.make_batch(layer.shape[0], PAGE, [ntok], device=DEV)
        idx = batch.kv_indices
        nb = idx.numel() * PAGE * 576 * 3
        rec("torch index+.to()", lambda idx=idx: layer[idx.long()].to(torch.bfloat16), nb, f"gather {ntok // 1024}K")
        for tile in (4096, 8192):
            rec(f"gather_cast t{tile}", lambda idx=idx, tile=tile: gather_cast(layer, idx, tile=tile), nb,
                f"gather {ntok // 1024}K")
    # DSA: the top-2048 rows of 64 requests (one-token pages of 576 values), each request's slots in
    # its own context of the pool: whole rows a program (the default) against 64-value column blocks
    del layer
    for ctx in ((8192, 32768, 131072) if DEV == "cuda" else (512,)):
        B, topk = (64, 2048) if DEV == "cuda" else (2, 64)
        kv_rows = kvpool.random_pool(1, B * ctx, 1, device=DEV).layer(0)  # [B * ctx, 1, 576]
        g = torch.Generator(device="cpu").manual_seed(ctx)
        idx = (torch.stack([torch.randperm(ctx, generator=g)[:topk] + b * ctx for b in range(B)])
               .flatten().to(torch.int32).to(DEV))
        nb = idx.numel() * 576 * 3
        for tile, nw, bc in ((8192, 8, 64), (8192, 8, None), (8192, 4, None), (16384, 8, None), (4096, 4, None)):
            name = f"rows t{tile} w{nw} " + ("c64" if bc else "whole")
            rec(name, lambda idx=idx, kv=kv_rows, tile=tile, nw=nw, bc=bc: gather_cast(kv, idx, tile=tile, num_warps=nw,
                block_c=bc), nb, f"top2048 64x{ctx // 1024}K" if DEV == "cuda" else "rows smoke")
        del kv_rows
        # the same slots from a 656-byte fp8_ds_mla pool (read 656, write 1152 a row): rows x warps a program
        ds_rows = kvpool.random_pool(1, B * ctx, 1, device=DEV, kv_layout="fp8_ds_mla").layer(0)  # [N, 1, 656] u8
        nb = idx.numel() * (656 + 1152)
        for r, nw, s4 in ((16, 4, False), (8, 4, False), (4, 4, False), (4, 2, False), (2, 2, False),
                          (16, 4, True), (8, 4, True), (4, 4, True), (4, 2, True), (2, 2, True)):
            rec(f"ds rows r{r} w{nw}" + (" s4" if s4 else ""), lambda idx=idx, kv=ds_rows, r=r, nw=nw, s4=s4:
                ds_mla_to_bf16(kv, idx, rows=r, num_warps=nw, scale4=s4), nb,
                f"top2048 64x{ctx // 1024}K" if DEV == "cuda" else "rows smoke")
        del ds_rows


# ---------------------------------------------------------------------------------------------
def env_info():
    gpu = DEV == "cuda"
    info = dict(gpu=torch.cuda.get_device_name(0) if gpu else "cpu (smoke)", torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, git_rev=os.environ.get("LAB_GIT_REV", "unknown"),
                sms=torch.cuda.get_device_properties(0).multi_processor_count if gpu else 0,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                                         "--format=csv,noheader"], capture_output=True, text=True,
                                        timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"unknown ({e})"
    if info["git_rev"] == "unknown":
        try:
            info["git_rev"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                             text=True, timeout=10).stdout.strip() or "unknown"
        except Exception:  # noqa: BLE001
            pass
    return info


def mark_checked(results):
    """Each timed variant gets the verdict of its correctness checks (all cases, both split modes)."""
    verdict = {}
    for r in results["correctness"]:
        name = r["kernel"].split("/")[0]
        if name.startswith("mla_decode(bf16"):
            name = "bf16"
        verdict[name] = verdict.get(name, True) and bool(r.get("ok"))
    for r in results["timings"]:
        base = "bf16" if r["group"] == "bf16_pool" else r["variant"].split("/")[0]
        if base in verdict:
            r["checked"] = "ok" if verdict[base] else "FAIL"


def print_table(results):
    ceil = results["ceilings"]
    log("\n=== correctness: " + f"{sum(r.get('ok', False) for r in results['correctness'])}/"
        f"{len(results['correctness'])} ok; failures:")
    for r in results["correctness"]:
        if not r.get("ok"):
            log(f"  FAIL {r['kernel']} {r['shape']} rel={r.get('rel_err')} lse={r.get('lse_err')} {r.get('error', '')}")
    log(f"\n=== ceilings: copy {ceil.get('copy_bw_TBps', 0):.2f} TB/s, bf16 matmul "
        f"{ceil.get('bf16_matmul_TFLOPs', 0):.0f} TFLOP/s   ({results['env']['gpu']}, torch "
        f"{results['env']['torch']}, triton {results['env']['triton']}, rev {results['env']['git_rev'][:10]})")
    log(f"{'group':10s} {'variant':27s} {'shape':13s} {'us':>8s} {'TB/s':>5s} {'TFLOP/s':>7s} {'%ceil':>5s} "
        f"{'x bf16':>6s} check")
    for r in results["timings"]:
        if "us" not in r:
            log(f"{r['group']:10s} {r['variant']:27s} {r['shape']:13s} ERROR {r.get('error', '')[:60]}")
            continue
        sp = r.get("speedup_vs_bf16_pool")
        log(f"{r['group']:10s} {r['variant']:27s} {r['shape']:13s} {r['us']:8.1f} {r['kv_TBps']:5.2f} "
            f"{r.get('TFLOPs', 0):7.1f} {r['pct_ceiling']:5.1f} {'      ' if sp is None else f'{sp:6.2f}'} "
            f"{r.get('checked', '')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--only", default="", help="regex on variant/kernel names")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "data" / "kernels")))
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check,ceil,time,cast")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the Triton interpreter: "
                    "runs the script's code paths without a GPU (numbers meaningless)")
    opts = ap.parse_args()
    global DEV
    if opts.cpu_smoke:
        DEV = "cpu"
        opts.no_precompile = True
    elif not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU (or --cpu-smoke)")
    skip = set(filter(None, opts.skip.split(",")))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = QUICK_SHAPES if opts.quick else SHAPES
    if DEV == "cpu":
        shapes = [(16, 2, 200), (128, 1, 70)]
    results = dict(env=env_info(), command=" ".join(sys.argv), ceilings={}, correctness=[], timings=[])
    log(json.dumps(results["env"]))
    t0 = time.time()
    if not opts.no_precompile and "time" not in skip:
        try:
            precompile(shapes, opts.only, workers=min(14, os.cpu_count() or 4))
        except Exception as e:  # noqa: BLE001
            log(f"precompile failed ({e}); compiling on first use")
    sections = [("ceil", lambda: ceilings(results["ceilings"])),
                ("check", lambda: correctness(results, opts.only)),
                ("time", lambda: timings(results, shapes, opts.only, results["ceilings"])),
                ("cast", lambda: cast_timings(results, opts.only, results["ceilings"]))]
    for name, fn in sections:
        if name in skip:
            continue
        t = time.time()
        log(f"--- {name}")
        try:
            fn()
        except Exception:  # noqa: BLE001
            results.setdefault("errors", []).append(traceback.format_exc())
            log(traceback.format_exc())
        log(f"--- {name} done in {time.time() - t:.0f} s")
        (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1, default=str))
    results["wall_s"] = time.time() - t0
    mark_checked(results)
    (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1, default=str))
    keys = ["group", "variant", "shape", "H", "B", "L", "us", "kv_TBps", "TFLOPs", "pct_ceiling",
            "speedup_vs_bf16_pool", "checked", "error"]
    with open(out / "gpu_kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results["timings"]:
            w.writerow(r)
    print_table(results)
    log(f"wrote {out / 'gpu_kernels.json'} and .csv; {results['wall_s']:.0f} s in all")


if __name__ == "__main__":
    main()
