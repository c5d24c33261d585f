#!/usr/bin/env python3
"""The DSA indexer's logits and top-k on one GPU: ``torch.topk`` beside the Triton top-k's
(labkit.kernels.topk_select, the candidates from the logits kernel) at 1 and 64 requests of 8K,
32K and 128K tokens (GLM-5: 32 index heads x 128, top-2048, KV pages of 64, pages scattered). Per
shape, first the check: the Triton slots of every request against torch.topk's values (the logits
at the slots, sorted, equal to the top-k values: the same set up to ties), then CUDA-graph medians
over rotating layers (labkit.timing.graph_times) of: the logits kernel, bare torch.topk,
select_tokens with each top-k, and logits + top-k captured together.
Targets (logits + top-k): 20 us at 1 x 32K, 110 us at 64 x 32K.
A table last; gpu_topk.json and gpu_topk.csv under --out, rewritten after every row.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_topk.py --out DIR [--sweep]
        [--tunings atomic atomic_w16]
    python3 scripts/gpu_topk.py --device cpu --small --out /tmp/topk   # tiny shapes, Triton's interpreter

--sweep also times top-k tunings (splits, warps, tiles, how the rounds count, a sampled prefilter, the
CUDA C kernel) at
every shape, each checked first, alone and after the logits.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # labkit from a plain checkout

import torch  # noqa: E402

from labkit import config, envinfo, kvpool, timing  # noqa: E402
from labkit.indexer import (INDEX_PAGE, IndexCache, index_page_bytes, logits_and_slots, logits_triton,  # noqa: E402
                            positions_of, quantize_index_keys, quantize_index_query, sample_table, select_tokens,
                            token_ids)
from labkit.kernels.topk_cuda import topk_cuda  # noqa: E402
from labkit.kernels.topk_select import auto_splits, topk_select  # noqa: E402

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (64, 8192), (64, 32768), (64, 131072), (128, 32768)]
SMALL = [(1, 512), (2, 2048)]  # --small: the interpreter's sizes
TARGET_US = {(1, 32768): 20.0, (64, 32768): 110.0}  # logits + top-k, per layer
PAGE = 64
TUNINGS = {  # --sweep: launcher keywords of topk_select, by name (splits past the SM count are refused)
    "one": dict(splits=1), "one_w16": dict(splits=1, num_warps=16), "s2": dict(splits=2), "s8": dict(splits=8),
    "w4": dict(num_warps=4), "w16": dict(num_warps=16), "db4": dict(digit_bits=4), "db4_w16": dict(digit_bits=4, num_warps=16),
    "b1024": dict(block=1024), "b16k": dict(block=16384), "cb256": dict(cand_block=256),
    "s2_b2k": dict(splits=2, block=2048), "s2_b1k": dict(splits=2, block=1024),
    # the row rounds counted by atomics (one a key)
    "atomic": dict(count="atomic"), "atomic_w16": dict(count="atomic", num_warps=16),
    "atomic_db4": dict(count="atomic", digit_bits=4), "atomic_b16k": dict(count="atomic", block=16384),
    "atomic_s2": dict(count="atomic", splits=2),
    # candidates by a sampled threshold first (labkit.kernels.topk_prefilter), then one program a request
    "sample1k": dict(sample=1024), "sample2k": dict(sample=2048), "sample4k": dict(sample=4096),
    "sample2k_w16": dict(sample=2048, num_warps=16), "sample2k_w4": dict(sample=2048, num_warps=4),
    "sample2k_db4": dict(sample=2048, digit_bits=4), "sample2k_b2k": dict(sample=2048, block=2048),
    # logits + top-k, the candidates appended by the logits kernel above a threshold from this many
    # sampled logits a request (labkit.indexer.logits_and_slots; column total_cand_us)
    "cand256": dict(cand=256), "cand512": dict(cand=512), "cand1k": dict(cand=1024), "cand2k": dict(cand=2048),
    # the same, sampling runs of 16 / 64 consecutive positions (whole rows of an index-key page)
    "cand1k_r16": dict(cand=1024, run=16), "cand1k_r64": dict(cand=1024, run=64),
    # the select over the candidates (one program a request, latency-bound: 15.8 us at 64 x 32K, run 20)
    "cand1k_w16": dict(cand=1024, num_warps=16), "cand1k_w4": dict(cand=1024, num_warps=4),
    "cand1k_b2k": dict(cand=1024, block=2048), "cand1k_db4": dict(cand=1024, digit_bits=4),
    "cand1k_regs0": dict(cand=1024, regs=0), "cand1k_regs8k": dict(cand=1024, regs=8192),
    "cand1k_regs8k_w16": dict(cand=1024, regs=8192, num_warps=16),
    "sample2k_regs": dict(sample=2048, regs=4096),  # the prefilter's candidates in registers
    # the logits kernel alone (81% of copy at 64 x 32K on the H200, run 10): tiles, stages, warps
    "lg_bt128": dict(logits=dict(block_t=128)), "lg_s3": dict(logits=dict(num_stages=3)),
    "lg_w8": dict(logits=dict(num_warps=8)), "lg_bt128_w8": dict(logits=dict(block_t=128, num_warps=8)),
    # the keys by TMA, a whole index page a copy (index_logits(tma=True)), not row by row
    "lg_tma": dict(logits=dict(tma=True)), "lg_tma_s3": dict(logits=dict(tma=True, num_stages=3)),
    "lg_tma_s4": dict(logits=dict(tma=True, num_stages=4)), "lg_tma_w8": dict(logits=dict(tma=True, num_warps=8)),
    "lg_tma_t4": dict(logits=dict(tma=True, tiles=4)), "lg_tma_t16_s3": dict(logits=dict(tma=True, tiles=16, num_stages=3)),
    "lg_t4": dict(logits=dict(tiles=4)), "lg_t16_s3": dict(logits=dict(tiles=16, num_stages=3)),
    # 128-position tiles (run 21 on the H200: 75.9 against 79.8 us at 64 x 32K): their tile count, wider ones
    "lg_bt128_t4": dict(logits=dict(block_t=128, tiles=4)), "lg_bt128_t2": dict(logits=dict(block_t=128, tiles=2)),
    "lg_bt256": dict(logits=dict(block_t=256)), "lg_t16": dict(logits=dict(tiles=16)),
    # the top-k in CUDA C (labkit.kernels.topk_cuda): one block a request, keys in shared memory
    "cuda": dict(impl="cuda"), "cuda_agg": dict(impl="cuda", agg=True), "cuda_t512": dict(impl="cuda", threads=512),
    "cuda_t256": dict(impl="cuda", threads=256), "cuda_db8": dict(impl="cuda", digit_bits=8),
    "cuda_db12": dict(impl="cuda", digit_bits=12), "cuda_nocache": dict(impl="cuda", cache=False),
    "cuda_u8": dict(impl="cuda", unroll=8), "cuda_u1": dict(impl="cuda", unroll=1),
    "cuda_s0": dict(impl="cuda", sample=0), "cuda_s1k": dict(impl="cuda", sample=1024),
    "cuda_s2k": dict(impl="cuda", sample=2048), "cuda_s4k_db12": dict(impl="cuda", sample=4096, digit_bits=12),
    "cuda_db12_t512": dict(impl="cuda", digit_bits=12, threads=512),
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Case:
    """One shape: B requests of ``context`` tokens, ``layers`` layers of index keys and queries,
    the logits of every layer computed once (the top-k timings read them)."""

    def __init__(self, cfg, batch_size: int, context: int, layers: int, device: str, seed: int = 0):
        self.topk, self.layers = cfg.index_topk, layers
        pages = batch_size * -(-context // PAGE) + 8
        self.batch = kvpool.make_batch(pages, PAGE, [context] * batch_size, seed=seed, device=device)
        self.cache = _random_cache(layers, pages * PAGE, cfg.index_head_dim, device, seed)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        H, D = cfg.index_n_heads, cfg.index_head_dim
        q = torch.randn(layers, batch_size, H, D, generator=gen, device=device)
        w = torch.randn(layers, batch_size, H, generator=gen, device=device) * (H * D) ** -0.5
        self.q_idx, self.weights = quantize_index_query(q, w)
        self.logits = [self.index(layer) for layer in range(layers)]
        self.tables = {}

    def index(self, layer: int, **tuning) -> torch.Tensor:
        return logits_triton(self.q_idx[layer], self.weights[layer], self.cache, layer, self.batch, **tuning)

    def select_slots(self, logits, impl: str = "triton", **kw) -> torch.Tensor:
        """topk_select (impl "triton") or topk_cuda (impl "cuda") with ``kw``."""
        b, fn = self.batch, topk_cuda if impl == "cuda" else topk_select
        return fn(logits, b.kv_lens, b.kv_indptr, b.kv_indices, b.page_size, self.topk, **kw)

    def candidates(self, layer: int, sample: int, run: int = 1, select: dict | None = None) -> torch.Tensor:
        """Logits and slots with the top-k's candidates from the logits kernel (its slots); ``select``:
        the radix select's tuning."""
        if (sample, run) not in self.tables:
            self.tables[sample, run] = sample_table(self.batch, sample, run)
        return logits_and_slots(self.q_idx[layer], self.weights[layer], self.cache, layer, self.batch, self.topk,
                                self.tables[sample, run], select)[1]

    def torch_topk(self, logits) -> torch.Tensor:
        return select_tokens(logits, self.batch, self.topk, check=False, topk_impl="torch")


def _random_cache(layers: int, tokens: int, head_dim: int, device: str, seed: int) -> IndexCache:
    """Index keys of random data for ``tokens`` tokens per layer, quantized per token, in chunks."""
    n_pages = -(-tokens // INDEX_PAGE)
    cache = IndexCache(torch.empty(layers, n_pages, index_page_bytes(head_dim), dtype=torch.uint8,
                                   device=device), head_dim)
    gen = torch.Generator(device=device).manual_seed(seed + 104729)
    for layer in range(layers):
        for p0 in range(0, n_pages, 8192):
            p1 = min(n_pages, p0 + 8192)
            k8, scale = quantize_index_keys(torch.randn(p1 - p0, INDEX_PAGE, head_dim, generator=gen, device=device))
            cache.k_idx(layer)[p0:p1] = k8
            cache.k_scale(layer)[p0:p1] = scale
    return cache


def agreement(case: Case, slots: torch.Tensor, logits: torch.Tensor) -> int:
    """Requests whose slots are topk distinct tokens of their own context with the top-k logits
    (sorted, equal to torch.topk's values over the context)."""
    b, k = case.batch, case.topk
    pos = positions_of(b, slots)
    past = token_ids(b, torch.arange(logits.shape[1], device=logits.device).expand(logits.shape[0], -1)) < 0
    x = logits.masked_fill(past, -math.inf)
    want = torch.topk(x, k, dim=1).values
    got = x.gather(1, pos.clamp_min(0)).sort(1, descending=True).values
    srt = pos.sort(1).values
    ok = (pos >= 0).all(1) & (srt[:, 1:] != srt[:, :-1]).all(1) & (got == want).all(1)
    return int(ok.sum())


def graph_us(fn_of_layer, a) -> float:
    return timing.graph_times(fn_of_layer, range(a.layers), replays=a.replays, warmup=a.warmup).us


def measure(cfg, B: int, ctx: int, a, tunings: dict) -> list[dict]:
    """The rows of one shape: the main one (every column), then one per tuning (--sweep)."""
    row = dict(batch=B, context=ctx, topk=cfg.index_topk, target_us=TARGET_US.get((B, ctx)))
    try:
        case = Case(cfg, B, ctx, a.layers, a.device)
        L = case.logits
        row["splits"] = auto_splits(B, ctx, a.device)
        row["agree"] = agreement(case, case.select_slots(L[0]), L[0])
        row["requests"] = B
        t = {
            "logits_us": lambda i: case.index(i),
            "torch_topk_us": lambda i: torch.topk(L[i], case.topk, dim=1, sorted=False),
            "torch_select_us": lambda i: case.torch_topk(L[i]),
            "triton_topk_us": lambda i: case.select_slots(L[i]),
            "total_torch_us": lambda i: case.torch_topk(case.index(i)),
            "total_triton_us": lambda i: case.select_slots(case.index(i)),
            "total_cand_us": lambda i: case.candidates(i, a.cand_sample),
        }
        row["cand_sample"] = a.cand_sample
        row["agree_cand"] = agreement(case, case.candidates(0, a.cand_sample), L[0])
        for name, fn in t.items():
            row[name] = graph_us(fn, a)
        if row["target_us"] is not None:
            row["met"] = row["total_triton_us"] <= row["target_us"]
            row["met_cand"] = row["total_cand_us"] <= row["target_us"]
    except Exception as e:  # noqa: BLE001 - one failing shape must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return [row]
    rows = [row]
    for name, kw in tunings.items():
        r = dict(batch=B, context=ctx, topk=cfg.index_topk, tuning=name, kwargs=json.dumps(kw), requests=B)
        try:
            if "logits" in kw:  # the logits kernel alone, with this tuning (checked against the default's)
                tk = kw["logits"]
                r["agree"] = B if torch.allclose(case.index(0, **tk), L[0], rtol=1e-4, atol=1e-6) else 0
                r["logits_us"] = graph_us(lambda i: case.index(i, **tk), a)
                rows.append(r)
                continue
            if "cand" in kw:  # logits + top-k with the candidates from the logits kernel
                run, sel = kw.get("run", 1), {k: v for k, v in kw.items() if k not in ("cand", "run")}
                r["agree"] = agreement(case, case.candidates(0, kw["cand"], run, sel), L[0])
                r["total_cand_us"] = graph_us(lambda i: case.candidates(i, kw["cand"], run, sel), a)
                rows.append(r)
                continue
            r["agree"] = agreement(case, case.select_slots(L[0], **kw), L[0])
            r["triton_topk_us"] = graph_us(lambda i: case.select_slots(L[i], **kw), a)
            r["total_triton_us"] = graph_us(lambda i: case.select_slots(case.index(i), **kw), a)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(r)
    del case
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def write(out: Path, res: dict) -> None:
    (out / "gpu_topk.json").write_text(json.dumps(res, indent=1, default=str))
    keys = sorted({k for r in res["rows"] for k in r})
    with open(out / "gpu_topk.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(res["rows"])


def table(rows) -> str:
    cols = [("batch", "B", "%d"), ("context", "ctx", "%d"), ("tuning", "tuning", "%s"), ("agree", "ok", "%d"),
            ("logits_us", "logits", "%.1f"), ("torch_topk_us", "topk", "%.1f"), ("torch_select_us", "t.sel", "%.1f"),
            ("triton_topk_us", "triton", "%.1f"), ("total_torch_us", "tot.t", "%.1f"),
            ("total_triton_us", "tot.tri", "%.1f"), ("total_cand_us", "tot.cand", "%.1f"),
            ("target_us", "target", "%.0f"), ("splits", "spl", "%d")]
    lines = [" ".join(f"{h:>8}" for _, h, _ in cols)]
    for r in rows:
        cells = [(fmt % r[k]) if r.get(k) is not None else "-" for k, _, fmt in cols]
        lines.append(" ".join(f"{c:>8}" for c in cells) + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="tiny shapes and top-128 (for the CPU interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time the top-k tunings")
    ap.add_argument("--tunings", nargs="+", choices=sorted(TUNINGS), help="only these tunings (implies --sweep)")
    ap.add_argument("--shapes", nargs="+", help="only these shapes, as BxCONTEXT (e.g. 64x32768)")
    ap.add_argument("--cand-sample", type=int, default=1024, help="logits sampled per request for the candidates")
    ap.add_argument("--layers", type=int, default=4, help="layers rotated through in each graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="graph replays before the timed ones")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu --small)")
    cfg = config.load_model("glm5")
    shapes = SMALL if a.small else SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes]
    if a.small:
        cfg = replace(cfg, index_topk=128)
        a.layers, a.replays, a.warmup = min(a.layers, 2), min(a.replays, 2), 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(env=envinfo.env_info(a.device), command=" ".join(sys.argv), rows=[])
    tunings = {k: TUNINGS[k] for k in a.tunings} if a.tunings else TUNINGS if a.sweep else {}
    for B, ctx in shapes:
        log(f"B={B} context={ctx}")
        for row in measure(cfg, B, ctx, a, tunings):
            log(json.dumps(row, default=str))
            res["rows"].append(row)
        write(out, res)
    print(table(res["rows"]))
    bad = [r for r in res["rows"] if "error" in r or r.get("agree") != r.get("requests")
           or r.get("agree_cand", r.get("requests")) != r.get("requests")]
    log(f"wrote {out / 'gpu_topk.json'} and .csv; {len(bad)} rows with an error or a mismatch")


if __name__ == "__main__":
    main()
