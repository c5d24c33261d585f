"""Tables from recorded rows: one path's speedup over another, where it stops paying, our fastest
FP8-native kernel, the decode step, a benchmark run against FlashInfer and against the targets."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .config import load_model
from .lab import MAIN_PATHS, records_of
from .stepmodel import predict, rest_from_seed


def speedup(df: pd.DataFrame, x: str, base: str = "full_pool_cast", new: str = "gather_cast",
            value: str = "device_ms") -> pd.DataFrame:
    """``value`` (default: the kernels' device time) of two paths per value of ``x``, and base / new."""
    t = df.pivot_table(index=x, columns="path", values=value)[[base, new]]
    return t.assign(speedup=t[base] / t[new]).reset_index()


def break_even(sp: pd.DataFrame, x: str = "read_fraction"):
    """The smallest ``x`` at which the speedup is 1 or less; None if it pays everywhere swept."""
    lost = sp[sp.speedup <= 1]
    return None if lost.empty else float(lost[x].min())


def fastest_fp8_native(records: pd.DataFrame, value: str = "device_ms") -> pd.Series:
    """The record of the fastest of our ``fp8_native`` kernels (peers left out): the minimum of
    ``value`` over those records; what notebook 03 reports."""
    ours = records[(records.path == "fp8_native") & (records.impl != "flashinfer") & records[value].notna()]
    if ours.empty:
        raise ValueError(f"no fp8_native records with {value!r} among {len(records)} records")
    return ours.iloc[int(ours[value].to_numpy().argmin())]  # by position: concatenated records repeat labels


# -- the report: from recorded runs to a decode step ------------------------------------------------
SEED_TOK_S = {"full_pool_cast": 10.5, "gather_cast": 13.5}  # the study's single stream


def step_table(df: pd.DataFrame, rest_ms: float | None = None) -> pd.DataFrame:
    """Decode step and tok/s per path and run from the recorded side-by-side (``paths`` rows).

    step = model layers x (path ms - bf16_pool ms) + rest: what each path adds to a BF16 kernel
    on a BF16 pool, with the rest of the step (the attention kernel included) from the seed. ms is
    the kernels' device time (a server replays decode as a CUDA graph: no launch cost).
    Without a bf16_pool row the path's whole time counts (an upper bound on the step).
    """
    rest = rest_from_seed() if rest_ms is None else rest_ms
    tables, paths_rows = [], records_of(df, "paths")
    for run, d in (paths_rows.groupby("run") if len(paths_rows) else []):
        d = d.sort_values("env_timestamp").groupby("path").last()
        ms = d.device_ms if "device_ms" in d else d.median_ms
        base = ms.get("bf16_pool", 0.0)
        layers = load_model(d.model.iloc[0]).num_hidden_layers
        paths = [p for p in MAIN_PATHS if p in d.index]
        t = predict({p: ms[p] - base for p in paths}, layers, rest)
        tables.append(t.assign(run=run, device=d.env_device_name.iloc[0], ms_per_layer=ms[paths].values,
                               layers=layers, rest_ms=rest, seed_tok_s=[SEED_TOK_S.get(p) for p in paths],
                               rel_err=d.rel_err[paths].values))
    cols = ["run", "device", "path", "ms_per_layer", "layers", "rest_ms", "step_ms", "tok_s", "seed_tok_s", "rel_err"]
    return pd.concat(tables)[cols].reset_index(drop=True) if tables else pd.DataFrame(columns=cols)


# -- a benchmark run against FlashInfer's BF16 kernel, per shape and precision -----------------------
SHAPE_KEYS = ["shape", "heads", "batch", "ctx", "topk", "kv_layout"]


def _fastest(d: pd.DataFrame, value: str) -> pd.Series:
    """The record of ``d`` with the lowest ``value`` (by position: concatenated records repeat labels)."""
    return d.iloc[int(d[value].to_numpy().argmin())]


def against_flashinfer(records: pd.DataFrame, value: str = "graph_us") -> pd.DataFrame:
    """Per benchmark shape (``SHAPE_KEYS``, FlashInfer's own row by heads, batch, context and top-k):
    FlashInfer's BF16-pool kernel, and the fastest of our ``fp8_native`` kernels per precision with its
    relative error and FlashInfer / ours (above 1: ours is faster). Pass one run's records (FlashInfer
    measured beside ours); shapes without a FlashInfer BF16 record are left out."""
    ok = records[records[value].notna()]
    key = SHAPE_KEYS[:5]
    fi = ok[(ok.impl == "flashinfer") & (ok.path == "bf16_pool")].groupby(key)[value].min()
    ours = ok[(ok.path == "fp8_native") & (ok.impl != "flashinfer")]
    rows = []
    for shape, d in ours.groupby(SHAPE_KEYS, sort=False):
        if shape[:5] not in fi.index:
            continue
        ref = float(fi[shape[:5]])
        row = dict(zip(SHAPE_KEYS, shape), flashinfer_bf16=ref)
        for prec in ("fast", "accurate"):
            p = d[d.precision == prec]
            if p.empty:
                continue
            best = _fastest(p, value)
            row.update({prec: float(best[value]), f"{prec}_impl": best.impl, f"{prec}_rel_err": float(best.rel_err),
                        f"fi/{prec}": ref / float(best[value])})
        rows.append(row)
    return pd.DataFrame(rows)


# -- ... and against the targets (data/targets.json) -------------------------------------------------
TARGETS = Path(__file__).resolve().parent.parent / "data" / "targets.json"


def load_targets(path=None) -> dict:
    return json.loads(Path(path or TARGETS).read_text())


def against_targets(table: pd.DataFrame, targets: dict | None = None) -> pd.DataFrame:
    """Each target shape found in ``table`` (``against_flashinfer`` of one run), per precision: the
    target and ours in us, FlashInfer's BF16 kernel in the targets and in the run, and whether the
    target is met. Where FlashInfer drifts more than ``fi_tolerance`` from the targets' figure, the
    ratio counts: met when FlashInfer (run) / ours >= FlashInfer (targets) / target. An accurate row
    also needs its relative error within ``max_rel_err``. Shapes not in the run are left out."""
    targets = load_targets() if targets is None else targets
    tol, max_err = targets["fi_tolerance"], targets.get("max_rel_err", {})
    rows = []
    for t in targets["rows"]:
        m = table[(table.heads == t["heads"]) & (table.batch == t["batch"]) & (table.ctx == t["ctx"])
                  & (table.topk == t["topk"]) & (table.kv_layout == t.get("kv_layout", "fp8_per_tensor"))]
        if m.empty:
            continue
        r = m.iloc[0]
        drift = r.flashinfer_bf16 / t["flashinfer_bf16"] - 1.0
        by_ratio = abs(drift) > tol
        for prec in ("fast", "accurate"):
            if pd.isna(r.get(prec)):
                continue
            needed, reached = t["flashinfer_bf16"] / t[prec], r.flashinfer_bf16 / r[prec]
            met = reached >= needed if by_ratio else r[prec] <= t[prec]
            met = bool(met and r[f"{prec}_rel_err"] <= max_err.get(prec, float("inf")))
            rows.append(dict(heads=t["heads"], batch=t["batch"], ctx=t["ctx"], topk=t["topk"], precision=prec,
                             target_us=t[prec], ours_us=r[prec], impl=r[f"{prec}_impl"],
                             rel_err=r[f"{prec}_rel_err"], fi_targets=t["flashinfer_bf16"], fi_run=r.flashinfer_bf16,
                             fi_drift=drift, counts="ratio" if by_ratio else "us", needed=needed, reached=reached,
                             met=met))
    return pd.DataFrame(rows)


def layout_gap(records: pd.DataFrame, value: str = "graph_us", within: float | None = None) -> pd.DataFrame:
    """Per sparse shape measured on both FP8 layouts in one run's records, per precision: the fastest
    ``fp8_native`` kernel of ours on each layout and the 656-byte layout's time over the per-tensor
    one's; ``met`` where that ratio is at most 1 + ``within`` (default: the targets' ``ds_mla_within``,
    issue 16's "within 10%"). Shapes measured on one layout only are left out."""
    within = load_targets()["ds_mla_within"] if within is None else within
    ok = records[records[value].notna() & (records.path == "fp8_native") & (records.impl != "flashinfer")
                 & (records.topk > 0)]
    rows = []
    for (heads, batch, ctx, topk, prec), d in ok.groupby(["heads", "batch", "ctx", "topk", "precision"], sort=False):
        pt, ds = d[d.kv_layout == "fp8_per_tensor"], d[d.kv_layout == "fp8_ds_mla"]
        if pt.empty or ds.empty:
            continue
        pt, ds = _fastest(pt, value), _fastest(ds, value)
        ratio = float(ds[value]) / float(pt[value])
        rows.append(dict(heads=heads, batch=batch, ctx=ctx, topk=topk, precision=prec, per_tensor=float(pt[value]),
                         per_tensor_impl=pt.impl, ds_mla=float(ds[value]), ds_mla_impl=ds.impl,
                         ds_mla_rel_err=float(ds.rel_err), ratio=ratio, met=bool(ratio <= 1 + within)))
    return pd.DataFrame(rows)
