"""The decode paths side by side over a grid of shapes: checked, timed, tabled, recorded.

    python -m labkit.bench --grid gpu [--write-select]   # or: labkit bench --grid gpu
    python -m labkit.bench --grid cpu                    # tiny; CPU figures only show that it runs

Every implementation of every path and FlashInfer's MLA kernels (when they import) run on the same
batch, dense or sparse (top-k token slots), on an FP8 pool of the shape's layout and on a BF16 pool
of the same values. Each is planned once (``Backend.plan``), checked against the float32 oracle of
the same run (``rel_err``), then timed through ``labkit.timing``: ``median_ms`` by do_bench (L2
flushed), ``graph_us`` from CUDA-graph replays over rotating layers, ``host_us`` the eager wall time
per call. Rows carry bytes, FLOPs, GB/s, TFLOP/s and percent of the roofline measured in the same
run, ``precision``, ``topk`` (0 = dense), ``kv_layout``, peak extra memory and the environment, and
go to ``<run_dir>/bench.parquet``; what cannot run here is a row whose ``note`` says why. After a GPU
run the preference table that ``backends.select`` reads is written into the run folder, and with
``--write-select`` into ``data/select/`` as well.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from . import backends, kvpool, memory, preferences, reference, results, roofline, timing
from .kvpool import KVPool


@dataclass(frozen=True)
class Shape:
    name: str  # what the shape is for: mem, heads, one, sparse, seed
    heads: int
    batch: int
    ctx: int
    pool_tokens: int = 0  # 0: just enough pages for the batch, plus 5%
    page_size: int = 64
    topk: int = 0  # sparse: top-k token slots per request drawn from its context; 0: dense
    kv_layout: str = "fp8_per_tensor"  # the FP8 pool's layout (labkit.kvlayout)

    def pool(self) -> int:
        need = self.batch * -(-self.ctx // self.page_size) * self.page_size
        return self.pool_tokens or (int(need * 1.05) // self.page_size + 1) * self.page_size


K = 1024
TOPK = 2048
SEED_POOL = 495_040  # the seed's 495K-token pool, rounded to 64-token pages
GRIDS = {
    "cpu": [Shape("mem", 4, 2, 300, page_size=16), Shape("seed", 4, 1, 256, pool_tokens=4 * K, page_size=16),
            *[Shape("sparse", 4, 2, 300, page_size=1, topk=64, kv_layout=lay)
              for lay in ("fp8_per_tensor", "fp8_ds_mla")]],
    "gpu": [  # the targets of the FP8-native issue, FlashInfer in the same run, most wanted first
        Shape("mem", 16, 64, 8 * K), *[Shape("heads", h, 64, 8 * K) for h in (64, 128)],
        *[Shape("sparse", h, b, 32 * K, page_size=1, topk=TOPK, kv_layout=lay)
          for h, b in ((16, 64), (64, 64), (128, 128)) for lay in ("fp8_per_tensor", "fp8_ds_mla")],
        *[Shape("one", h, 1, 8 * K) for h in (16, 64, 128)],
        Shape("mem", 16, 32, 32 * K), Shape("heads", 32, 64, 8 * K), Shape("mem", 8, 64, 8 * K),
    ],
    "gpu-heads": [*[Shape("heads", h, 64, 8 * K) for h in (64, 128, 32)], *[Shape("one", h, 1, 8 * K) for h in (16, 64, 128)],
                  *[Shape("sparse", h, b, 32 * K, page_size=1, topk=TOPK) for h, b in ((16, 64), (64, 64), (128, 128))],
                  Shape("mem", 16, 64, 8 * K)],
    "gpu-sparse": [Shape("sparse", h, b, 32 * K, page_size=1, topk=TOPK, kv_layout=lay)
                   for h, b in ((16, 64), (64, 64), (128, 128)) for lay in ("fp8_per_tensor", "fp8_ds_mla")],
    "gpu-host": [Shape("one", h, 1, 8 * K) for h in (16, 64, 128)],  # host time per eager call, FlashInfer beside
    "gpu-quick": [Shape("mem", 16, 64, 8 * K), Shape("heads", 128, 64, 8 * K), Shape("one", 64, 1, 8 * K),
                  Shape("sparse", 64, 64, 32 * K, page_size=1, topk=TOPK)],
}
# peers: (label, backend, pool it reads); every registered implementation of ours is measured too
PEERS = [("flashinfer_mla+cast", "flashinfer_mla", "fp8"), ("flashinfer_mla[bf16]", "flashinfer_mla", "bf16"),
         ("flashinfer_mla_fp8", "flashinfer_mla_fp8", "fp8")]
CPU_TRITON = ("fp8_native.triton",)  # the CPU grid's one interpreted kernel: the interpreter is slow
# full_pool_cast.seed is full_pool_cast.triton's attention after torch's .to(): the notebooks time it
GPU_SKIP = ("full_pool_cast.seed",)
SEED_PATHS = ("full_pool_cast", "gather_cast", "fp8_native")  # the seed's pool: whole-pool casts are slow
SM_SCALE = 1 / 16  # GLM-5: 1/sqrt(192 + 64)
REF_TOL = 5e-2  # a provider further than this from the oracle is reported, not timed


def providers(device: str, names=None) -> list[tuple]:
    """(label, backend name, "fp8" | "bf16" pool): every implementation of ours registered here (on a
    GPU without the torch references, on a CPU the torch paths and ``CPU_TRITON``), then the peers,
    registered or not (a row says why)."""
    backends._load_optional()
    ours = []
    for n in backends.names():
        b = backends.get(n)
        keep = (b.impl != "torch" and n not in GPU_SKIP) if device == "cuda" else (b.impl == "torch" or n in CPU_TRITON)
        if keep and b.impl != "flashinfer":
            ours.append((n, n, "bf16" if b.path == "bf16_pool" else "fp8"))
    return [p for p in ours + PEERS if names is None or p[0] in names]


def _pools(shape: Shape, device, seed: int, layers: int):
    fp8 = kvpool.random_pool(layers, shape.pool(), shape.page_size, device=device, seed=seed, kv_layout=shape.kv_layout)
    bf16 = KVPool(torch.stack([fp8.dequant(i, torch.bfloat16) for i in range(layers)]), torch.ones(layers),
                  fp8.kv_lora_rank)  # the same real values
    return {"fp8": fp8, "bf16": bf16}


def _batch(shape: Shape, pool: KVPool, seed: int):
    lens = [shape.ctx] * shape.batch
    if shape.topk:
        return kvpool.sparse_batch_for_pool(pool, lens, shape.topk, seed=seed, per_layer=True)
    return kvpool.batch_for_pool(pool, lens, seed=seed)


def _measure(call, layers: int, device: str, one_request: bool = True) -> dict:
    """median/p20/p80 (do_bench), graph_us (CUDA graph over rotating layers) and host_us of ``call(layer)``
    (10 calls a loop; at one request, where the host is what it measures, ``run_shape`` times every
    provider's calls side by side instead)."""
    gpu = device == "cuda"
    t = timing.bench(lambda: call(0), warmup_ms=25, rep_ms=100 if gpu else 20, device=device, min_reps=3)
    g = (timing.graph_times(call, range(layers), device=device) if gpu else
         timing.graph_times(call, range(layers), replays=2, warmup=1, device=device))
    host = float("nan") if one_request else timing.host_us(  # one request: side by side, in run_shape
        call, layers=layers, calls=10 if gpu else 2, repeats=5 if gpu else 1, warmup=2 if gpu else 0, device=device)
    return dict(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, timing_device=t.device,
                graph_us=g.us, graph_method=g.method, host_us=host)


def _caller(plan, q_nope, q_pe):
    """``call(layer)`` of one provider's plan (bound here: a lambda in run_shape's loop would see the
    loop's last plan once the loop has moved on, as the side-by-side host timing calls them)."""
    return lambda layer: plan.run(q_nope, q_pe, layer)


def run_shape(shape: Shape, provs, device: str, ceilings, seed: int = 0, progress=None, layers: int = 4) -> list[dict]:
    """One row per provider at ``shape``: checked against the oracle, then timed (or a ``note``)."""
    pools = _pools(shape, device, seed, layers)
    batch = _batch(shape, pools["fp8"], seed + 1)
    qn, qp = kvpool.make_queries(shape.batch, shape.heads, device=device, seed=seed + 2)
    b0 = batch.with_slots(batch.slots(0)) if shape.topk else batch
    ref = reference.mla_decode(qn, qp, pools["fp8"].dequant(0), b0, SM_SCALE, dtype=torch.float32)
    rows, calls = [], {}
    for label, name, which in provs:
        pool = pools[which]
        row = dict(shape=shape.name, label=label, backend=name, heads=shape.heads, batch=shape.batch, ctx=shape.ctx,
                   topk=shape.topk, fp8_layout=shape.kv_layout, pool_tokens=pool.pool_tokens, page_size=shape.page_size,
                   kv_dtype=pool.kv_dtype, kv_layout=pool.kv_layout, rel_err=float("nan"), note="")
        if progress is not None:
            progress.set_postfix_str(f"{shape.name} h{shape.heads} {shape.batch}x{shape.ctx} {label}")
            progress.update()
        try:
            b = backends.get(name)
            if shape.name == "seed" and b.path not in SEED_PATHS:
                raise ValueError(f"the seed's {pool.pool_tokens:,}-token pool is for the cast paths and fp8_native")
            b.check(qn, pool, batch)
        except ValueError as e:
            rows.append({**row, "note": str(e)[:300]})
            continue
        path = "bf16_pool" if which == "bf16" else b.path  # FlashInfer on a BF16 pool: the bf16_pool path
        row.update(path=path, impl=b.impl, precision=b.precision_on(pool.kv_layout))
        plan = b.plan(pool, batch, shape.heads, SM_SCALE, qn.dtype)
        call = _caller(plan, qn, qp)
        try:
            row["rel_err"] = reference.rel_err(call(0), ref)
        except Exception as e:  # noqa: BLE001 - one failing provider must not end the run
            rows.append({**row, "note": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        if not row["rel_err"] <= REF_TOL:
            rows.append({**row, "note": f"rel_err {row['rel_err']:.2e} > {REF_TOL}: not timed"})
            continue
        try:
            row.update(_measure(call, layers, device, shape.batch == 1),
                       extra_bytes=memory.extra_memory(lambda: call(0), device))
        except Exception as e:  # noqa: BLE001
            rows.append({**row, "note": f"timing: {type(e).__name__}: {str(e)[:300]}"})
            continue
        # against the roof of the MMA its products use; time = the CUDA-graph median where there is one
        t_ms = row["graph_us"] / 1e3 if row.get("graph_us") == row.get("graph_us") else row["median_ms"]
        row.update(roofline.achieved(path, t_ms, ceilings, mma=roofline.mma_of(name), pool_tokens=pool.pool_tokens,
                                     tokens_read=batch.tokens_read, kv_dtype=pool.kv_dtype, heads=shape.heads,
                                     batch=shape.batch, kv_layout=pool.kv_layout))
        rows.append(row)
        calls[label] = call
    if shape.batch == 1 and calls:  # host time: every provider's calls interleaved
        gpu = device == "cuda"
        host = timing.host_us_interleaved(calls, layers=layers, calls=50 if gpu else 2, rounds=7 if gpu else 1,
                                          warmup=2 if gpu else 0, device=device)
        for row in rows:
            if row["label"] in host:
                row["host_us"] = host[row["label"]]
    return rows


RATIOS = {"bf16/fp8": "bf16_pool.triton", "seed/fp8": "full_pool_cast.seed",
          "gather/fp8": "gather_cast.triton", "fi_bf16/fp8": "flashinfer_mla[bf16]",
          "fi_cast/fp8": "flashinfer_mla+cast", "fi_fp8/fp8": "flashinfer_mla_fp8"}


def table(df):
    """Microseconds per provider per shape (CUDA-graph replays where recorded, else do_bench), and how
    many times slower each other path is than the fastest ``fp8_native`` Triton/Gluon kernel at that
    shape (> 1: fp8_native wins)."""
    df = df.copy()
    us = df.median_ms * 1e3
    if "graph_us" in df:
        us = df.graph_us.where(df.graph_us.notna(), us)
    df["us"] = us
    index = [c for c in ("shape", "heads", "batch", "ctx", "topk", "fp8_layout") if c in df]
    piv = df.pivot_table(index=index, columns="label", values="us")
    fp8 = [c for c in piv.columns if c.startswith("fp8_native.") and c.split(".")[1] != "torch"]
    if fp8:
        best = piv[fp8].min(axis=1)
        for name, col in RATIOS.items():
            if col in piv.columns:
                piv[name] = (piv[col] / best).round(2)
    return piv.round(1)


def host_table(df):
    """Eager host microseconds per call at one request (the ``one`` shapes), each provider beside
    FlashInfer's in the same run; ``x_flashinfer`` > 1: ours costs the host more than FlashInfer's."""
    one = df[(df["shape"] == "one") & df.host_us.notna()] if "host_us" in df else df.iloc[:0]
    if one.empty:
        return one
    piv = one.pivot_table(index="heads", columns="label", values="host_us")
    fi = [c for c in piv.columns if c.startswith("flashinfer")]
    if fi:
        base = piv[fi].min(axis=1)
        piv = piv.join(piv.drop(columns=fi).div(base, axis=0).add_prefix("x_flashinfer "))
    return piv.round(2)


def write_select(df, run_dir, to_data: bool, arch: str, source: str) -> list:
    """The preference table from this run's checked rows: into the run folder, and into data/select/."""
    ok = df[df.get("graph_us").notna()] if "graph_us" in df else df.iloc[:0]
    if ok.empty:
        return []
    table_ = preferences.from_records(ok, arch, source)
    paths = [preferences.save(table_, run_dir)]
    if to_data:
        paths.append(preferences.save(table_))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="labkit bench", description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None, help="shape grid (default: by device)")
    ap.add_argument("--providers", nargs="*", default=None, help="provider labels to keep")
    ap.add_argument("--run-dir", default=None, help="write into this run folder (default: a new one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-shape", type=int, default=0, metavar="I",
                    help="start at the grid's I-th shape (0-based): resume a run its time limit cut short")
    ap.add_argument("--write-select", action="store_true",
                    help="also write the preference table into data/select/<arch>.json (GPU runs)")
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
    provs = providers(device, args.providers)
    rows, path = [], None
    layers = 4 if device == "cuda" else 2
    shapes = GRIDS[grid][args.from_shape:]
    bar = tqdm(total=len(shapes) * len(provs), desc="bench", unit="run")
    for shape in shapes:
        for r in run_shape(shape, provs, device, ceilings, args.seed, bar, layers):
            rows.append(results.make_record(
                r.pop("path", ""), r.pop("backend"), r.pop("impl", ""), r.pop("median_ms", float("nan")),
                r.pop("p20_ms", float("nan")), r.pop("p80_ms", float("nan")), params=r, device_env=env,
                grid=grid, copy_gbps=ceilings.copy_gbps, matmul_tflops=ceilings.matmul_tflops,
                fp8_tflops=ceilings.fp8_tflops))
        # after every shape, so that a run stopped by its time limit keeps what it measured
        frame = pd.DataFrame(rows)
        path = (results.write_records(run_dir, rows, "bench") if path is None else
                results.atomic_write_with(path, lambda tmp: frame.to_parquet(tmp, index=False)))
        backends.clear_plans()  # cached plans hold this shape's pools
        if device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    df = pd.DataFrame(rows)
    pd.set_option("display.width", 250)
    cols = ["shape", "label", "heads", "batch", "ctx", "topk", "kv_layout", "median_ms", "graph_us", "host_us",
            "gbps", "pct_roofline", "precision", "rel_err", "note"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print()
    if df.median_ms.notna().any():
        print(table(df[df.median_ms.notna()]).to_string())
        host = host_table(df)
        if len(host):
            print("\nhost us per eager call, one request:\n" + host.to_string())
    if device == "cuda":
        for p in write_select(df, run_dir, args.write_select, preferences.arch_of(device), str(run_dir)):
            print(f"preference table -> {p}")
    print(f"\n{len(rows)} records -> {path}")
    if args.run_dir is None:  # a folder given by --run-dir belongs to its caller (gpu_study.sh), which marks it
        what = "labkit bench " + " ".join(sys.argv[1:] if argv is None else argv)
        results.mark_finished(run_dir, what, records=len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
