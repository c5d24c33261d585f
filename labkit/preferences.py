"""Which implementation of a path is fastest where: the table ``backends.select`` reads.

The table is measured, not written by hand: ``labkit.bench`` times every implementation side by
side and ``from_records`` orders them, per GPU architecture, path, dense or sparse, precision,
head-count band and batch band, by median device time. It lives in ``data/select/<arch>.json``
with the run it came from. A GPU with no table falls back to ``FALLBACK`` (an order stated here,
from the H200 figures in the lab's notes); the CPU has its own order: the torch paths first,
because Triton's interpreter costs milliseconds per program.

    {"arch": "sm_90", "source": "...", "rows": [
       {"path": "fp8_native", "sparse": false, "precision": "fast", "heads": [1, 16], "batch": [9, 1024],
        "order": ["gluon", "triton_q8", ...], "median_us": [89.1, 185.0, ...]}, ...]}
"""
from __future__ import annotations

import json
from pathlib import Path

from .config import DATA_DIR

TABLE_DIR = DATA_DIR / "select"
HEAD_BANDS = ((1, 16), (17, 32), (33, 64), (65, 128))
BATCH_BANDS = ((1, 8), (9, 1 << 20))
# Unknown GPU: kernels in the order the H200 measurements rank them; the first allowed one wins.
FALLBACK = {
    "full_pool_cast": ("triton", "seed", "torch"),
    "gather_cast": ("triton", "torch"),
    "fp8_native": ("gluon", "gluon_acc", "triton_rows", "triton_q8", "triton_rows_acc", "triton", "torch"),
    "bf16_pool": ("triton", "torch"),
}
CPU_ORDER = ("torch",)  # then whatever else runs on a CPU, in registration order


def arch_of(device) -> str:
    """"sm_90" for an H100/H200, "cpu" for the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def band(value: int, bands) -> list:
    for lo, hi in bands:
        if lo <= value <= hi:
            return [lo, hi]
    return [bands[-1][0], bands[-1][1]]


def load(arch: str, table_dir: Path = TABLE_DIR) -> dict | None:
    path = Path(table_dir) / f"{arch}.json"
    return json.loads(path.read_text()) if path.exists() else None


def order(path: str, arch: str, heads: int, batch: int, sparse: bool, precision: str,
          table_dir: Path = TABLE_DIR, kv_layout: str | None = None) -> tuple[tuple, str]:
    """(implementations fastest first, where the order came from: "table", "fallback" or "cpu").
    A row measured on ``kv_layout`` wins over one of another layout (or of none, older tables)."""
    if arch == "cpu":
        return CPU_ORDER, "cpu"
    table = load(arch, table_dir)
    if table:
        hb, bb = band(heads, HEAD_BANDS), band(batch, BATCH_BANDS)
        rows = [r for r in table["rows"] if (r["path"], r["sparse"], r["precision"], r["heads"], r["batch"]) == (
            path, sparse, precision, hb, bb)]
        rows.sort(key=lambda r: r.get("kv_layout") != kv_layout)
        if rows:
            return tuple(rows[0]["order"]), "table"
    return FALLBACK.get(path, ()), "fallback"


def from_records(df, arch: str, source: str, time_col: str = "graph_us") -> dict:
    """A table from benchmark records (one row per shape and backend, with ``path``, ``impl``,
    ``heads``, ``batch``, ``topk``, ``precision``, ``time_col``); peers (FlashInfer) are left out.
    ``fast`` ranks every implementation, ``accurate`` only the accurate ones."""
    df = df[(df.impl != "flashinfer") & df[time_col].notna()].copy()
    df["hb"] = df.heads.map(lambda h: tuple(band(int(h), HEAD_BANDS)))
    df["bb"] = df.batch.map(lambda b: tuple(band(int(b), BATCH_BANDS)))
    df["sparse"] = df.topk > 0
    if "kv_layout" not in df:
        df["kv_layout"] = None
    rows = []
    for (path, sparse, hb, bb, layout), g in df.groupby(["path", "sparse", "hb", "bb", "kv_layout"], dropna=False):
        for precision in ("fast", "accurate"):
            sel = g if precision == "fast" else g[g.precision == "accurate"]
            if sel.empty:
                continue
            t = sel.groupby("impl")[time_col].median().sort_values()
            rows.append(dict(path=path, sparse=bool(sparse), precision=precision, heads=list(hb),
                             batch=list(bb), order=list(t.index), median_us=[round(float(v), 2) for v in t],
                             **({"kv_layout": layout} if isinstance(layout, str) else {})))
    return dict(arch=arch, source=source, time=time_col, rows=rows)


def save(table: dict, table_dir: Path = TABLE_DIR) -> Path:
    from .results import atomic_write_text

    Path(table_dir).mkdir(parents=True, exist_ok=True)
    return atomic_write_text(Path(table_dir) / f"{table['arch']}.json", json.dumps(table, indent=1) + "\n")
