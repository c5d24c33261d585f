"""The decode paths side by side over a grid of shapes: checked, timed, tabled, recorded.

    python -m labkit.bench --grid gpu          # or: labkit bench --grid gpu
    python -m labkit.bench --grid cpu          # small; CPU figures only show that it runs

Every provider is first checked against an fp32 oracle on the same batch, then timed with
``labkit.timing.bench`` (warm-up, L2 flush, medians of device events). Rows carry bytes, FLOPs,
achieved GB/s and TFLOP/s, percent of the roofline measured in the same run, peak extra memory
and the environment, and go to ``<run_dir>/bench.parquet``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from . import backends, kvpool, memory, reference, results, roofline, timing
from .kvpool import KVPool


@dataclass(frozen=True)
class Shape:
    name: str  # what the shape is for: mem, compute, heads, seed
    heads: int
    batch: int
    ctx: int
    pool_tokens: int = 0  # 0: just enough pages for the batch, plus 5%
    page_size: int = 64

    def pool(self) -> int:
        need = self.batch * -(-self.ctx // self.page_size) * self.page_size
        return self.pool_tokens or (int(need * 1.05) // self.page_size + 1) * self.page_size


K = 1024
SEED_POOL = 495_040  # the seed's 495K-token pool, rounded to 64-token pages
GRIDS = {
    "cpu": [Shape("mem", 4, 2, 300, page_size=16), Shape("seed", 4, 1, 256, pool_tokens=16 * K, page_size=16)],
    "gpu": [
        *[Shape("mem", h, b, c) for h in (8, 16) for b, c in ((32, 4 * K), (64, 8 * K), (128, 8 * K), (32, 32 * K))],
        *[Shape("heads", h, 64, 8 * K) for h in (32, 64, 128)],
        Shape("compute", 128, 32, 32 * K),
        *[Shape("seed", h, 1, 8 * K, pool_tokens=SEED_POOL) for h in (16, 64)],
    ],
    "gpu-quick": [Shape("mem", 16, 64, 8 * K), Shape("compute", 128, 64, 8 * K),
                  Shape("seed", 16, 1, 8 * K, pool_tokens=SEED_POOL)],
}
# (label, backend, which pool it reads); a provider whose backend is not registered is skipped
PROVIDERS = [
    ("full_pool_cast.seed", "full_pool_cast.seed", "fp8"),
    ("full_pool_cast.triton", "full_pool_cast.triton", "fp8"),
    ("gather_cast.triton", "gather_cast.triton", "fp8"),
    ("fp8_native.triton", "fp8_native.triton", "fp8"),
    ("fp8_native.triton_q8", "fp8_native.triton_q8", "fp8"),
    ("fp8_native.triton_tma", "fp8_native.triton_tma", "fp8"),
    ("fp8_native.gluon", "fp8_native.gluon", "fp8"),
    ("bf16_pool.triton", "bf16_pool.triton", "bf16"),
    ("flashinfer_mla+cast", "flashinfer_mla", "fp8"),
    ("flashinfer_mla[bf16]", "flashinfer_mla", "bf16"),
    ("flashinfer_mla_fp8", "flashinfer_mla_fp8", "fp8"),
]


CPU_PROVIDERS = [(n, n, "fp8") for n in ("full_pool_cast.torch", "gather_cast.torch", "fp8_native.torch",
                                          "fp8_native.triton")] + [("bf16_pool.torch", "bf16_pool.torch", "bf16")]
SEED_PROVIDERS = {"full_pool_cast.seed", "full_pool_cast.triton", "gather_cast.triton", "fp8_native.triton",
                  "fp8_native.triton_q8", "fp8_native.triton_tma", "fp8_native.gluon",
                  "flashinfer_mla+cast", "flashinfer_mla_fp8", "full_pool_cast.torch", "gather_cast.torch",
                  "fp8_native.torch"}
SM_SCALE = 1 / 16  # GLM-5: 1/sqrt(192 + 64)
REF_TOL = 5e-2  # a provider further than this from the oracle is reported, not timed


def _pools(shape: Shape, device, seed: int):
    fp8 = kvpool.random_pool(1, shape.pool(), shape.page_size, device=device, seed=seed)
    bf16 = KVPool(fp8.dequant(0).to(torch.bfloat16)[None], torch.ones(1), fp8.kv_lora_rank)  # same values
    return {"fp8": fp8, "bf16": bf16}


def _providers(device: str, names=None):
    provs = PROVIDERS if device == "cuda" else CPU_PROVIDERS
    have = set(backends.names())
    provs = [p for p in provs if p[1] in have]
    return [p for p in provs if names is None or p[0] in names]


def run_shape(shape: Shape, providers, device: str, ceilings, seed: int = 0, progress=None) -> list[dict]:
    pools = _pools(shape, device, seed)
    batch = kvpool.batch_for_pool(pools["fp8"], [shape.ctx] * shape.batch, seed=seed + 1)
    qn, qp = kvpool.make_queries(shape.batch, shape.heads, device=device, seed=seed + 2)
    ref = reference.mla_decode(qn, qp, pools["fp8"].dequant(0), batch, SM_SCALE, dtype=torch.float32)
    rows = []
    for label, name, which in providers:
        if shape.name == "seed" and label not in SEED_PROVIDERS:
            continue
        b, pool = (backends.get(name) if isinstance(name, str) else name), pools[which]
        if shape.heads > b.max_heads:
            continue
        call = lambda: b.decode(qn, qp, pool, 0, batch, SM_SCALE)  # noqa: E731
        try:
            err = reference.rel_err(call(), ref)
        except Exception as e:  # noqa: BLE001 - one failing provider must not end the run
            print(f"  {label} at {shape}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            err = float("nan")
        row = dict(shape=shape.name, label=label, heads=shape.heads, batch=shape.batch, ctx=shape.ctx,
                   pool_tokens=pool.pool_tokens, page_size=shape.page_size, kv_dtype=pool.kv_dtype, rel_err=err)
        if not err <= REF_TOL:
            print(f"  {label} at {shape}: rel_err {err:.2e} (limit {REF_TOL}): not timed", file=sys.stderr)
            rows.append(row)
            continue
        t = timing.bench(call, warmup_ms=25, rep_ms=200 if device == "cuda" else 50)
        extra = memory.extra_memory(call, device)
        path = "bf16_pool" if which == "bf16" else b.path
        ach = roofline.achieved(path, t.median_ms, ceilings, pool_tokens=pool.pool_tokens,
                                tokens_read=batch.num_tokens, kv_dtype=pool.kv_dtype, heads=shape.heads,
                                batch=shape.batch)
        row.update(path=path, backend=b.name, impl=b.impl, median_ms=t.median_ms, p20_ms=t.p20_ms,
                   p80_ms=t.p80_ms, timing_device=t.device, extra_bytes=extra, **ach)
        rows.append(row)
        if progress:
            progress.set_postfix_str(f"{label} {t.us:.0f} us")
    return rows


RATIOS = {"bf16/fp8": "bf16_pool.triton", "seed/fp8": "full_pool_cast.seed",
          "gather/fp8": "gather_cast.triton", "fi_bf16/fp8": "flashinfer_mla[bf16]",
          "fi_cast/fp8": "flashinfer_mla+cast", "fi_fp8/fp8": "flashinfer_mla_fp8"}


def table(df):
    """Median us per provider per shape, and how many times slower each other path is than the
    fastest ``fp8_native`` Triton kernel at that shape (> 1: fp8_native wins)."""
    piv = df.pivot_table(index=["shape", "heads", "batch", "ctx"], columns="label", values="median_ms") * 1e3
    fp8 = [c for c in piv.columns if c.startswith("fp8_native.") and c.split(".")[1] != "torch"]
    if fp8:
        best = piv[fp8].min(axis=1)
        for name, col in RATIOS.items():
            if col in piv.columns:
                piv[name] = (piv[col] / best).round(2)
    return piv.round(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="labkit bench", description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None, help="shape grid (default: by device)")
    ap.add_argument("--providers", nargs="*", default=None, help="provider labels to keep")
    ap.add_argument("--run-dir", default=None, help="write into this run folder (default: a new one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grid = args.grid or ("gpu" if device == "cuda" else "cpu")
    if grid.startswith("gpu") and device != "cuda":
        print(f"error: --grid {grid} needs a CUDA device; allowed here: cpu", file=sys.stderr)
        return 2
    import pandas as pd
    from tqdm.auto import tqdm

    if device == "cpu":
        print("CPU run: Triton kernels run in the interpreter; CPU figures show that it runs, not speed.")
    run_dir = results.new_run_dir(tag=None) if args.run_dir is None else args.run_dir
    ceilings = roofline.measure_ceilings(device, cache_dir=run_dir)
    print(f"ceilings on {ceilings.device_name}: copy {ceilings.copy_gbps:.0f} GB/s, "
          f"matmul {ceilings.matmul_tflops:.1f} TFLOP/s ({ceilings.method})")
    env = results.env_info(device)
    provs = _providers(device, args.providers)
    rows = []
    bar = tqdm(GRIDS[grid], desc="bench", unit="shape")
    for shape in bar:
        for r in run_shape(shape, provs, device, ceilings, args.seed, bar):
            rows.append(results.make_record(
                r.pop("path", ""), r.pop("backend", r["label"]), r.pop("impl", ""), r.pop("median_ms", float("nan")),
                r.pop("p20_ms", float("nan")), r.pop("p80_ms", float("nan")), params=r, device_env=env,
                grid=grid, copy_gbps=ceilings.copy_gbps, matmul_tflops=ceilings.matmul_tflops))
    path = results.write_records(run_dir, rows, "bench")
    df = pd.DataFrame(rows)
    pd.set_option("display.width", 250)
    cols = ["shape", "label", "heads", "batch", "ctx", "median_ms", "gbps", "tflops", "pct_roofline", "bound",
            "rel_err", "extra_bytes"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print()
    print(table(df).to_string())
    print(f"\n{len(rows)} records -> {path}")
    if args.run_dir is None:  # a folder given by --run-dir belongs to its caller (gpu_study.sh), which marks it
        what = "labkit bench " + " ".join(sys.argv[1:] if argv is None else argv)
        results.mark_finished(run_dir, what, records=len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
