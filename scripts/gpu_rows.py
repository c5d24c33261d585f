"""The FP8 rows decode (``mla_decode_fp8_rows``) beside FlashInfer's MLA kernel (fa3, BF16 and FP8
pools) at the issue's target shapes, dense and sparse, on one GPU: each call checked against a float64
reference (rel. error), then timed by ``labkit.timing`` (CUDA-graph replays over rotating layers, and
do_bench with L2 flushes). fp8_ds_mla rows are timed both ways of applying their group scales
(config "default": ds_scales="widen"; config "groups"). A table last; CSV and JSON under --out,
rewritten after every row.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_rows.py --out DIR [--sweep]

--sweep adds tile configurations (BLOCK_N, BLOCK_H, splits, warps, stages, P.V mode) at a few
shapes; --budget-s ends the sweep (never the target shapes) when the time is spent.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402

from labkit import envinfo, kvlayout, kvpool, roofline, timing  # noqa: E402
from labkit.kernels.mla_decode_fp8_rows import mla_decode_fp8_rows  # noqa: E402

SM_SCALE = 1 / 16
TOPK, SPARSE_CTX = 2048, 32768
# (kind, heads, batch, context, fast target us, accurate target us, FlashInfer BF16 us from the issue)
TARGETS = [
    ("dense", 64, 64, 8192, 110, 160, 162), ("dense", 128, 64, 8192, 170, 250, 252),
    ("dense", 64, 1, 8192, 15, 20, 25), ("dense", 128, 1, 8192, 15, 20, 23),
    ("sparse", 16, 64, SPARSE_CTX, 25, 30, 50), ("sparse", 64, 64, SPARSE_CTX, 35, 55, 59),
    ("sparse", 128, 128, SPARSE_CTX, 95, 140, 143),
]
TUNE = {  # launcher tuning the sweep tries, by name; "ds_" names run on the fp8_ds_mla layout
    "pv8": dict(pv="fp8"), "bn32": dict(block_n=32), "bn128": dict(block_n=128), "s3": dict(num_stages=3),
    "qreg": dict(q_pre=False), "cta2": dict(ctas_per_sm=2), "bh32": dict(block_h=32), "bh64": dict(block_h=64),
    "bn32_cta2": dict(block_n=32, ctas_per_sm=2), "cta3": dict(ctas_per_sm=3),
    "ds_bn16": dict(block_n=16), "ds_bn64": dict(block_n=64), "ds_cta2": dict(ctas_per_sm=2),
    "ds_bn32": dict(block_n=32),  # ds names run ds_scales="widen" (the default) unless they say groups
    "ds_groups_bn64": dict(ds_scales="groups", block_n=64),
}
DS_MODES = (("default", {}), ("groups", dict(ds_scales="groups")))  # both timed at every target shape
SWEEP = {  # shape -> the tunings tried there (run 3: around the defaults chosen from run 2)
    ("dense", 64, 64, 8192): ("bn32_cta2", "s3", "ds_bn32"),
    ("dense", 128, 64, 8192): ("bn32_cta2", "qreg", "ds_bn32", "ds_cta2"),
    ("dense", 64, 1, 8192): ("bn32",),
    ("sparse", 16, 64, SPARSE_CTX): ("cta3", "bh64", "ds_bn32"),
    ("sparse", 64, 64, SPARSE_CTX): ("s3", "bn32_cta2", "ds_bn32", "ds_groups_bn64"),
}


def tuning(name: str):
    """(kv_layout, launcher kwargs) of a sweep entry."""
    return ("fp8_ds_mla" if name.startswith("ds_") else "fp8_per_tensor"), TUNE[name]


READ_BYTES = 400e6  # rotate over enough layers that a replay reads this much (L2 is 60 MB)
DEV = "cuda"
REPLAYS = 20  # graph replays per timing


class Case:
    """Pools (per layout), batch, slots and queries of one shape; the float64 reference per layout."""

    def __init__(self, kind, H, B, ctx, seed=0):
        self.kind, self.H, self.B, self.ctx = kind, H, B, ctx
        per_layer = B * min(ctx, TOPK if kind == "sparse" else ctx) * 576
        self.layers = max(2, min(32, math.ceil(READ_BYTES / per_layer)))
        ps = 1 if kind == "sparse" else 64
        tokens = (B * ctx // ps + 4) * ps
        self.pools = {lay: kvpool.random_pool(self.layers, tokens, ps, kv_layout=lay, device=DEV, seed=seed)
                      for lay in ("fp8_per_tensor", "fp8_ds_mla", "bf16")}
        self.batch = kvpool.batch_for_pool(self.pools["bf16"], [ctx] * B, seed=seed + 1)
        self.qn, self.qp = kvpool.make_queries(B, H, device=DEV, seed=seed + 2)
        self.slots = None
        if kind == "sparse":  # each request's slots at random from its own context (page size 1: rows)
            gen = torch.Generator(device=DEV).manual_seed(seed + 3)
            rows = self.batch.kv_indices.view(B, ctx).long()
            pick = torch.argsort(torch.rand(B, ctx, generator=gen, device=DEV), -1)[:, :TOPK]
            self.slots = torch.gather(rows, 1, pick).to(torch.int32).contiguous()
        self.reads = self.slots.long() if self.slots is not None else self._dense_rows()
        self.tokens_read = self.reads.numel()

    def _dense_rows(self):
        ps = self.batch.page_size
        pages = self.batch.kv_indices.view(self.B, -1).long()
        return (pages[:, :, None] * ps + torch.arange(ps, device=DEV)).flatten(1)[:, : self.ctx]

    def reference(self, layout):
        """float64 out [B, H, 512] over the rows each request reads, values as ``layout`` stores them."""
        pool = self.pools[layout]
        scale = 1.0 if layout != "fp8_per_tensor" else pool.scale(0)
        q = torch.cat([self.qn, self.qp], -1).double()
        out = torch.empty(self.B, self.H, 512, dtype=torch.float64, device=DEV)
        for b in range(self.B):
            kv = kvlayout.dequant(pool.rows(0)[self.reads[b]], layout, scale, torch.float64)
            out[b] = torch.softmax(q[b] @ kv.T * SM_SCALE, -1) @ kv[:, :512]
        return out

    def ours(self, layout, precision, **kw):
        pool = self.pools[layout]

        def call(layer):
            k_scale = 1.0 if layout == "fp8_ds_mla" else pool.scale(layer)
            common = dict(sm_scale=SM_SCALE, kv_layout=layout, k_scale=k_scale, precision=precision, **kw)
            if self.slots is not None:
                return mla_decode_fp8_rows(self.qn, self.qp, pool.rows(layer), token_indices=self.slots, **common)
            b = self.batch
            return mla_decode_fp8_rows(self.qn, self.qp, pool.rows(layer), kv_indptr=b.kv_indptr,
                                       kv_indices=b.kv_indices, kv_lens=b.kv_lens, page_size=b.page_size,
                                       max_len=self.ctx, **common)
        return call

    def flashinfer(self, layout):
        """FlashInfer fa3 planned once; sparse: page size 1, kv_indices = each request's slots."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        pool = self.pools[layout]
        w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), backend="fa3")
        qo = torch.arange(self.B + 1, dtype=torch.int32, device=DEV)
        if self.slots is not None:
            n = self.slots.shape[1]
            indptr = torch.arange(self.B + 1, dtype=torch.int32, device=DEV) * n
            indices, lens, ps = self.slots.flatten(), torch.full((self.B,), n, dtype=torch.int32, device=DEV), 1
        else:
            b = self.batch
            indptr, indices, lens, ps = b.kv_indptr, b.kv_indices, b.kv_lens, b.page_size
        w.plan(qo_indptr=qo, kv_indptr=indptr, kv_indices=indices, kv_len_arr=lens, num_heads=self.H,
               head_dim_ckv=512, head_dim_kpe=64, page_size=ps, causal=False, sm_scale=SM_SCALE,
               q_data_type=torch.bfloat16, kv_data_type=pool.dtype)

        def call(layer):
            kv = pool.rows(layer)[:, None, :] if ps == 1 else pool.layer(layer)
            if layout == "bf16":
                return w.run(q_nope=self.qn, q_pe=self.qp, ckv_cache=kv[..., :512], kpe_cache=kv[..., 512:])
            s = pool.scale(layer)  # FP8: scores and values both carry k_scale
            return w.run(q_nope=self.qn, q_pe=self.qp, ckv_cache=kv[..., :512], kpe_cache=kv[..., 512:],
                         ckv_scale=s, kpe_scale=s)
        return call


def splits_of(kind, layout, H, B, ctx, kw) -> int:
    """The launcher's default split count on a 132-SM H200 (kernels.mla_decode.default_num_splits)."""
    from labkit.kernels import mla_decode_fp8_rows as R

    bh = kw.get("block_h") or (64 if H > 32 else max(16, 1 << (H - 1).bit_length()))
    cfg = {**R.gpu_config(layout, bh, kw.get("ds_scales", "widen")), **kw}
    want = math.floor(cfg["ctas_per_sm"] * 132 / (B * math.ceil(H / bh)))
    most = max(1, math.ceil(min(ctx, TOPK if kind == "sparse" else ctx) / (cfg["block_n"] * 4)))
    return int(max(1, min(want, most, 64)))


def warm_specs() -> list:
    """Every kernel specialization the run and the GPU tests compile: (kind, layout, heads, precision,
    tuning, splits). The launcher specializes on layout, batch kind, page size, tile, head block,
    precision and on one split (output written directly) or several; heads 16 / 64 stand for their
    head blocks, splits 1 / 2 for direct / merged."""
    specs = set()
    for kind in ("dense", "sparse"):
        for layout in ("fp8_per_tensor", "fp8_ds_mla"):
            for prec in ("fast", "accurate"):
                modes = DS_MODES if layout == "fp8_ds_mla" else DS_MODES[:1]
                for H in (16, 64):
                    for splits in (1, 2):
                        for _, mode in modes:
                            specs.add((kind, layout, H, prec, tuple(mode.items()), splits))
                groups = dict(DS_MODES[1][1]) if layout == "fp8_ds_mla" else {}
                for kw in (dict(pv="fp8", **groups), dict(block_n=32)):  # tests/test_rows_kernel.py's variants
                    specs.add((kind, layout, 64, prec, tuple(sorted(kw.items())), 2))
    for (kind, H, B, ctx), names in SWEEP.items():
        for name in names:
            layout, kw = tuning(name)
            for prec in ("fast", "accurate"):
                splits = 1 if splits_of(kind, layout, H, B, ctx, kw) == 1 else 2
                specs.add((kind, layout, min(H, 64), prec, tuple(sorted(kw.items())), splits))
    return sorted(specs)


def _warm(specs) -> int:
    """Compile ``specs`` (one worker process) by launching each on a tiny batch; Triton's disk cache
    keeps the binaries for the timed run and the tests (the same specializations)."""
    done = 0
    for kind, layout, H, prec, kw, splits in specs:
        pool = kvpool.random_pool(1, 512, 1 if kind == "sparse" else 64, kv_layout=layout, device="cuda")
        batch = kvpool.batch_for_pool(pool, [256], seed=1)
        qn, qp = kvpool.make_queries(1, H, device="cuda")
        common = dict(sm_scale=SM_SCALE, kv_layout=layout, precision=prec, num_splits=splits, **dict(kw))
        try:
            if kind == "sparse":
                slots = batch.kv_indices.view(1, -1)[:, :64].contiguous()
                mla_decode_fp8_rows(qn, qp, pool.rows(0), token_indices=slots, **common)
            else:
                mla_decode_fp8_rows(qn, qp, pool.rows(0), kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
                                    kv_lens=batch.kv_lens, page_size=64, max_len=256, **common)
            done += 1
        except Exception as e:  # noqa: BLE001 - the timed run reports the failure with its row
            print("warm failed:", kind, layout, H, prec, kw, splits, type(e).__name__, str(e)[:200], flush=True)
    torch.cuda.synchronize()
    return done


def _warm_flashinfer() -> str:
    """FlashInfer compiles its fa3 MLA modules (BF16, FP8) at first use: do it beside the Triton work."""
    try:
        for kind in ("dense", "sparse"):
            case = Case(kind, 16, 1, 256)
            for layout in ("bf16", "fp8_per_tensor"):
                case.flashinfer(layout)(0)
        torch.cuda.synchronize()
        return "flashinfer ready"
    except Exception as e:  # noqa: BLE001
        return f"flashinfer warm-up failed: {type(e).__name__}: {str(e)[:200]}"


def warm(workers: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    specs = warm_specs()
    t0 = time.time()
    chunks = [specs[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers + 1, mp_context=mp.get_context("spawn")) as ex:
        fi = ex.submit(_warm_flashinfer)
        done = sum(ex.map(_warm, chunks))
        gk.log(fi.result())
    gk.log(f"warm: {done}/{len(specs)} specializations compiled in {time.time() - t0:.0f} s by {workers} processes")


def probe_fp8_readback() -> dict:
    """Does an fp8 register tile converted back to fp32 give the values it holds? Checked in a plain
    (blocked) layout and in the MMA accumulator layout (the p of a decode), against torch."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(a_ptr, b_ptr, out_ptr, DOT: tl.constexpr, N: tl.constexpr):
        r = tl.arange(0, N)
        off = r[:, None] * N + r[None, :]
        x = tl.load(a_ptr + off).to(tl.float32)
        if DOT:
            x = tl.dot(tl.load(a_ptr + off), tl.load(b_ptr + off))  # fp32, MMA layout
        tl.store(out_ptr + off, x.to(tl.float8e4nv).to(tl.float32))

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(-8, 9, (64, 64), generator=gen, device="cuda").to(torch.bfloat16)
    b = torch.randint(-8, 9, (64, 64), generator=gen, device="cuda").to(torch.bfloat16)
    res = {}
    for dot in (False, True):
        out = torch.empty(64, 64, device="cuda")
        k[(1,)](a, b, out, DOT=dot, N=64, num_warps=4)
        x = (a.float() @ b.float()) if dot else a.float()
        want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        res["mma_layout" if dot else "blocked"] = int((out != want).sum())  # mismatching elements of 4096
    return res


def measure(case, method, layout, precision, config, call, refs, ceil, target=None):
    row = dict(kind=case.kind, heads=case.H, batch=case.B, ctx=case.ctx, topk=TOPK if case.slots is not None else 0,
               method=method, kv_layout=layout, precision=precision, config=config, layers=case.layers,
               target_us=target)
    try:
        if layout not in refs:
            refs[layout] = case.reference(layout)
        out = call(0)
        if DEV == "cuda":
            torch.cuda.synchronize()
        row["rel_err"] = float((out.double() - refs[layout]).norm() / refs[layout].norm())
        row["graph_us"] = timing.graph_times(call, range(case.layers), replays=REPLAYS).us
        gpu = DEV == "cuda"
        row["bench_us"] = timing.bench(lambda: call(0), rep_ms=50 if gpu else 1, warmup_ms=25 if gpu else 1).us
        # the bytes and FLOPs of the lab's one roofline computation: KV rows read, query and output
        ach = roofline.achieved("fp8_native", row["graph_us"] / 1e3, ceil, pool_tokens=0,
                                tokens_read=case.tokens_read, heads=case.H, batch=case.B, kv_layout=layout)
        row["tb_s"], row["pct_copy"], row["tflop_s"] = ach["gbps"] / 1e3, ach["pct_bandwidth"], ach["tflops"]
        row["met"] = None if target is None else row["graph_us"] <= target
    except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    gk.log(json.dumps(row, default=str))
    return row


def write(out: Path, res: dict) -> None:
    (out / "gpu_rows.json").write_text(json.dumps(res, indent=1, default=str))
    keys = sorted({k for r in res["rows"] for k in r})
    with open(out / "gpu_rows.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(res["rows"])


def table(rows) -> str:
    head = f"{'kind':6} {'H':>3} {'B':>3} {'method':22} {'layout':14} {'prec':8} {'config':10} " \
           f"{'graph_us':>9} {'bench_us':>9} {'target':>6} {'rel_err':>8} {'%copy':>6} {'TFLOP/s':>7}"
    lines = [head]
    for r in rows:
        f = lambda k, fmt: (fmt % r[k]) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"{r['kind']:6} {r['heads']:>3} {r['batch']:>3} {r['method']:22} {r['kv_layout']:14} "
                     f"{r['precision']:8} {r['config']:10} {f('graph_us', '%.1f'):>9} {f('bench_us', '%.1f'):>9} "
                     f"{f('target_us', '%d'):>6} {f('rel_err', '%.1e'):>8} {f('pct_copy', '%.0f'):>6} "
                     f"{f('tflop_s', '%.0f'):>7}" + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="first compile every specialization in N processes, then exit (fills Triton's cache)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): the script's own check")
    a = ap.parse_args()
    global DEV, TOPK, TARGETS, SWEEP, READ_BYTES, REPLAYS
    if a.smoke:
        DEV, TOPK, READ_BYTES, REPLAYS = "cpu", 64, 1, 1
        TARGETS = [("dense", 20, 2, 100, 1, 1, 1), ("sparse", 16, 2, 200, 1, 1, 1)]
        SWEEP = {t[:4]: ("bn32", "pv8", "ds_bn32") for t in TARGETS}
        a.no_flashinfer = True
    if a.warm:
        warm(a.warm)
        return
    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = roofline.measure_ceilings(DEV, cache_dir=out)
    res = dict(env=envinfo.env_info(DEV), command=" ".join(sys.argv), copy_gbps=ceil.copy_gbps, rows=[])
    if DEV == "cuda":
        try:
            res["fp8_readback_mismatches"] = probe_fp8_readback()
        except Exception as e:  # noqa: BLE001
            res["fp8_readback_mismatches"] = f"{type(e).__name__}: {str(e)[:200]}"
        gk.log("fp8 -> fp32 read-back mismatches (of 4096):", res["fp8_readback_mismatches"])
    try:
        import flashinfer  # noqa: F401
        peers = not a.no_flashinfer
    except Exception as e:  # noqa: BLE001
        res["flashinfer"] = f"does not import: {e}"
        peers = False
    for kind, H, B, ctx, t_fast, t_acc, t_fi in TARGETS:
        case, refs = Case(kind, H, B, ctx), {}
        layouts = ("fp8_per_tensor", "fp8_ds_mla")
        for layout in layouts:
            for config, kw in (DS_MODES if layout == "fp8_ds_mla" else DS_MODES[:1]):
                for prec, tgt in (("fast", t_fast), ("accurate", t_acc)):
                    res["rows"].append(measure(case, "triton_rows", layout, prec, config,
                                               case.ours(layout, prec, **kw), refs, ceil, tgt))
                    write(out, res)
        if peers:
            for layout, name in (("bf16", "flashinfer_bf16"), ("fp8_per_tensor", "flashinfer_fp8")):
                res["rows"].append(measure(case, name, layout, "-", "fa3", case.flashinfer(layout), refs,
                                           ceil, t_fi if layout == "bf16" else None))
                write(out, res)
        if a.sweep and (kind, H, B, ctx) in SWEEP:
            for name in SWEEP[(kind, H, B, ctx)]:
                layout, kw = tuning(name)
                for prec in ("fast", "accurate"):
                    if time.time() - t0 > a.budget_s:
                        res.setdefault("skipped", []).append(f"{kind} h{H} b{B} {name} {prec}")
                        continue
                    res["rows"].append(measure(case, "triton_rows", layout, prec, name,
                                               case.ours(layout, prec, **kw), refs, ceil))
                    write(out, res)
        del case, refs
        if DEV == "cuda":
            torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    write(out, res)
    print(table(res["rows"]))


if __name__ == "__main__":
    main()
