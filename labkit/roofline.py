"""Bytes, FLOPs and the roofline of one decode layer, and the device's two measured ceilings.

Per layer, P = pool tokens, L = tokens the batch reads, B = requests, H = heads on the GPU:

    full_pool_cast  P*(row + 1152)  + L*1152      cast the whole layer, attend over the copy
    gather_cast     L*(row + 1152)  + L*1152      cast only what is read (fused gather+cast)
    fp8_native      L*row                         attention reads the pool as stored
    bf16_pool       L*1152                        a 16-bit kernel on a pool already in BF16

``row`` is the stored bytes per token of the ``kv_layout`` (labkit.kvlayout): 576 fp8_per_tensor,
656 fp8_ds_mla (512 e4m3 + 4 fp32 group scales + 64 bf16), 1152 bf16 (a BF16 pool has nothing to
cast). L of a sparse (DSA) batch is its valid slots, topk per request or the context when shorter:
``DecodeBatch.tokens_read``.
Every path also reads q (B*H*576*2) and writes out (B*H*512*2): counted for all paths, so the
paths compare on equal terms. These are the fewest bytes each path must move: the torch
implementations move more (e.g. ``gather_cast.torch`` writes an FP8 gathered copy first).
A gather copies whole pages, so pass ``tokens_read`` = pages x page_size when that matters.
FLOPs, the same for every path: 2*H*L*(576 + 512) (scores over 576 dims, values over 512).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import KV_BYTES
from .kvlayout import KV_LAYOUTS
from .results import atomic_write_text

PATHS = ("full_pool_cast", "gather_cast", "fp8_native", "bf16_pool")
BF16 = 2


def stored_row_bytes(kv_layout: str, d_ckv: int = 512, d_kpe: int = 64) -> int:
    """Bytes one token's latent row takes in the pool: 576 / 656 / 1152 for the GLM-5 shape."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r}; allowed: {list(KV_LAYOUTS)}")
    if kv_layout == "fp8_ds_mla":  # e4m3 NoPE, an fp32 scale per 128 of it, BF16 RoPE
        return d_ckv + 4 * (d_ckv // 128) + d_kpe * BF16
    return (d_ckv + d_kpe) * (BF16 if kv_layout == "bf16" else 1)


def layout_of(kv_dtype: str, kv_layout: str | None = None) -> str:
    """``kv_layout``, else the layout ``kv_dtype`` means ("fp8_e4m3" -> "fp8_per_tensor")."""
    if kv_dtype not in KV_BYTES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; allowed: {sorted(KV_BYTES)}")
    return kv_layout or ("bf16" if kv_dtype == "bf16" else "fp8_per_tensor")


def path_bytes(path: str, pool_tokens: int, tokens_read: int, kv_dtype: str = "fp8_e4m3", heads: int = 0,
               batch: int = 0, d_ckv: int = 512, d_kpe: int = 64, kv_layout: str | None = None) -> int:
    """Bytes one layer of ``path`` must move through device memory (see the module docstring).

    ``kv_layout`` (labkit.kvlayout name) sets the stored row; None: the one ``kv_dtype`` means."""
    layout = layout_of(kv_dtype, kv_layout)
    row = d_ckv + d_kpe  # values per token: 576
    stored = stored_row_bytes(layout, d_ckv, d_kpe)
    cast = stored + row * BF16 if layout != "bf16" else 0  # read stored + write BF16, per cast token
    attend16 = tokens_read * row * BF16  # a 16-bit kernel reads the BF16 rows
    q_out = batch * heads * (row + d_ckv) * BF16
    if path == "full_pool_cast":
        return pool_tokens * cast + attend16 + q_out
    if path == "gather_cast":
        return tokens_read * (cast or row * 2 * BF16) + attend16 + q_out  # BF16 pool: still a copy
    if path == "fp8_native":
        return tokens_read * stored + q_out
    if path == "bf16_pool":
        return attend16 + q_out
    raise ValueError(f"path={path!r}; allowed: {list(PATHS)}")


def path_flops(heads: int, tokens_read: int, d_ckv: int = 512, d_kpe: int = 64) -> int:
    """Attention FLOPs of one layer: 2*H*L*(576 + 512); a cast adds none."""
    return 2 * heads * tokens_read * (d_ckv + d_kpe + d_ckv)


# fp8_native kernels whose two products (QK^T, PV) run as FP8 MMAs; every other kernel multiplies in BF16
# scores (and for gluon also p @ V) on FP8 tensor cores; the rows kernels' p @ V is 16-bit, so the FP8
# roof is the higher, stricter one for them; triton_rows_acc's split query is two FP8 products
FP8_MMA = frozenset({"fp8_native.triton_q8", "fp8_native.gluon", "fp8_native.gluon_acc", "fp8_native.triton_rows",
                     "fp8_native.triton_rows_acc"})  # FlashInfer's FP8 path widens to BF16 first
MMAS = ("bf16", "fp8")


def mma_of(backend: str) -> str:
    """``fp8`` for a backend whose products run on FP8 tensor cores (``FP8_MMA``), else ``bf16``."""
    return "fp8" if backend in FP8_MMA else "bf16"


@dataclass
class Ceilings:
    """What the device can do, measured: copy bandwidth (read + write counted), BF16 matmul rate and
    FP8 matmul rate (``fp8_tflops``: ``torch._scaled_mm`` on e4m3; None where not measured: a CPU, a
    GPU below sm_89, a ceilings file from before it was measured)."""

    copy_gbps: float
    matmul_tflops: float
    device_name: str
    method: str
    fp8_tflops: float | None = None

    def pct_copy(self, nbytes: float, time_ms: float) -> float:
        """``nbytes`` moved in ``time_ms`` as a percentage (0..100) of the copy bandwidth."""
        return 100 * nbytes / time_ms / 1e6 / self.copy_gbps

    def tflops(self, mma: str = "bf16") -> float | None:
        """The matmul roof of ``mma`` (``bf16`` or ``fp8``) in TFLOP/s; None when not measured."""
        if mma not in MMAS:
            raise ValueError(f"mma={mma!r}; allowed: {list(MMAS)}")
        rate = self.matmul_tflops if mma == "bf16" else self.fp8_tflops
        return float(rate) if rate is not None and math.isfinite(rate) and rate > 0 else None


def fp8_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K], b [K, N] (any float dtype) as float8_e4m3fn: a row-major, b column-major (the
    layout ``torch._scaled_mm`` takes)."""
    return a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()


def fp8_matmul(a8: torch.Tensor, b8: torch.Tensor, one: torch.Tensor | None = None) -> torch.Tensor:
    """a8 @ b8 through ``torch._scaled_mm`` with unit scales: a8 [M, K], b8 [K, N] float8_e4m3fn
    from ``fp8_operands``; ``one``: a float32 scalar 1.0 on their device (made when not given).
    Returns [M, N] bfloat16."""
    one = torch.ones((), dtype=torch.float32, device=a8.device) if one is None else one
    return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def fp8_supported(device: torch.device) -> bool:
    """A CUDA device with FP8 tensor cores (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _measure(device: torch.device, copy_bytes: int, matmul_n: int) -> Ceilings:
    from .timing import bench

    cuda = device.type == "cuda"
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)  # never zeros
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src), device=device)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    t_mm = bench(lambda: a @ b, device=device)
    fp8, fp8_note = None, "no FP8 matmul ceiling on the CPU" if not cuda else "no FP8 tensor cores (below sm_89)"
    if fp8_supported(device):
        (a8, b8), one = fp8_operands(a, b), torch.ones((), dtype=torch.float32, device=device)
        t8 = bench(lambda: fp8_matmul(a8, b8, one), device=device)
        fp8, fp8_note = 2 * matmul_n**3 / t8.median_ms / 1e9, f"{matmul_n}^3 e4m3 torch._scaled_mm (bf16 out)"
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    method = (f"median {t_copy.method}: {copy_bytes / 2**30:g} GiB copy (read+write), "
              f"{matmul_n}^3 {str(dtype).removeprefix('torch.')} random matmul; {fp8_note}")
    return Ceilings(2 * copy_bytes / t_copy.median_ms / 1e6, 2 * matmul_n**3 / t_mm.median_ms / 1e9,
                    name, ("CPU " if not cuda else "") + method, fp8)


def measure_ceilings(device="cuda", cache_dir=None, copy_bytes: int | None = None,
                     matmul_n: int | None = None) -> Ceilings:
    """Measure once and cache as ``<cache_dir>/ceilings-<device>.json`` (the run folder).

    CUDA: 2 GiB device-to-device copy, 8192^3 BF16 matmul and, from sm_89, 8192^3 FP8 (e4m3)
    ``torch._scaled_mm``. CPU: 64 MiB copy, 1024^3 FP32 matmul, no FP8 ceiling (None), labelled CPU
    in ``device_name`` and ``method``. A cached file without ``fp8_tflops`` loads with None.
    """
    dev = torch.device(device)
    cache = Path(cache_dir) / f"ceilings-{dev.type}.json" if cache_dir else None
    if cache is not None and cache.exists():
        return Ceilings(**json.loads(cache.read_text()))
    cuda = dev.type == "cuda"
    c = _measure(dev, copy_bytes or (2 << 30 if cuda else 64 << 20), matmul_n or (8192 if cuda else 1024))
    if cache is not None:
        atomic_write_text(cache, json.dumps(asdict(c), indent=1))
    return c


def achieved(path: str, time_ms: float, ceilings: Ceilings, mma: str = "bf16", **shape) -> dict:
    """Achieved rates of one layer of ``path`` taking ``time_ms``, against the ceilings.

    ``shape``: pool_tokens, tokens_read, heads, batch, kv_dtype, d_ckv, d_kpe, kv_layout (as path_bytes).
    ``mma``: the tensor cores the kernel's products use (``mma_of(backend)``); ``fp8`` takes the FP8
    matmul rate where it was measured, else the BF16 one. Percentages are 0..100.
    ``roofline_ms`` = max(bytes / copy bandwidth, FLOPs / matmul rate); ``bound`` names the larger
    term; ``pct_roofline`` = roofline_ms / time_ms * 100.
    """
    nbytes = path_bytes(path, **shape)
    flops = path_flops(shape.get("heads", 0), shape["tokens_read"],
                       shape.get("d_ckv", 512), shape.get("d_kpe", 64))
    rate = ceilings.tflops(mma) or ceilings.matmul_tflops
    mem_ms = nbytes / (ceilings.copy_gbps * 1e6)
    math_ms = flops / (rate * 1e9)
    gbps, tflops = nbytes / time_ms / 1e6, flops / time_ms / 1e9
    roof = max(mem_ms, math_ms)
    return dict(bytes=nbytes, flops=flops, intensity=flops / nbytes, gbps=gbps, tflops=tflops,
                pct_bandwidth=ceilings.pct_copy(nbytes, time_ms), pct_compute=100 * tflops / rate,
                bound="memory" if mem_ms >= math_ms else "compute", pct_roofline=100 * roof / time_ms,
                roofline_ms=roof)


COLOURS = {"bf16": "tab:blue", "fp8": "tab:orange"}


def place_labels(points_px, box_px, marker_px: float = 4.0, rings: int = 8):
    """Offsets (pixels, [N, 2]) that put a ``box_px`` = (width, height) label beside each point of
    ``points_px`` ([N, 2], display pixels) with no label over another label or over any point.

    Greedy, in the order given: the first free spot on rings of 8 directions around the point, each
    ring one label size further out; where every spot is taken, the one that overlaps least."""
    import numpy as np

    pts = np.asarray(points_px, dtype=float).reshape(-1, 2)
    w, h = (float(v) for v in box_px)
    half = np.array([w / 2, h / 2])
    dirs = np.array([(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (0, 1), (-1, 0), (0, -1)], dtype=float)
    placed, out = [], np.zeros_like(pts)
    for i, p in enumerate(pts):
        best, best_cost = None, np.inf
        for k in range(1, rings + 1):
            for d in dirs:
                off = d * (half + marker_px + 1 + (k - 1) * np.array([w, h]) / 2)
                cost = _overlap(p + off, half, placed, pts, marker_px)
                if cost < best_cost:
                    best, best_cost = off, cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        out[i] = best
        placed.append(p + best)
    return out


def _overlap(centre, half, placed, pts, marker_px) -> float:
    """Area a label box at ``centre`` shares with the labels already placed and every point's marker."""
    def inter(c2, h2):
        dx = min(centre[0] + half[0], c2[0] + h2[0]) - max(centre[0] - half[0], c2[0] - h2[0])
        dy = min(centre[1] + half[1], c2[1] + h2[1]) - max(centre[1] - half[1], c2[1] - h2[1])
        return max(dx, 0.0) * max(dy, 0.0)

    m = (marker_px, marker_px)
    return sum(inter(c, half) for c in placed) + sum(inter(q, m) for q in pts)


def _mma_column(points):
    if "mma" in points:
        return [str(m) for m in points["mma"]]
    if "backend" in points:
        return [mma_of(str(b)) for b in points["backend"]]
    return ["bf16"] * len(points)


def plot_roofline(points, ceilings: Ceilings, ax=None):
    """Log-log roofline: attainable TFLOP/s against intensity (FLOP/B). One marker per row of
    ``points`` (columns label, intensity, tflops; ``mma`` = ``bf16`` | ``fp8``, else taken from
    ``backend`` by ``mma_of``), coloured by the MMA its products use and drawn under that MMA's roof
    (BF16 solid; FP8 dashed where measured). Each marker gets a number placed clear of the others
    (``place_labels``); the legend beside the axes says which number is which label. Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    mmas = _mma_column(points)
    xs, ys = np.asarray(points["intensity"], float), np.asarray(points["tflops"], float)
    roofs = {m: ceilings.tflops(m) for m in MMAS}
    ridges = [r * 1e3 / ceilings.copy_gbps for r in roofs.values() if r]
    lo = min([min(ridges) / 30] + list(xs / 2))
    hi = max([max(ridges) * 30] + list(xs * 2))
    x = np.geomspace(lo, hi, 200)
    roof_lines = []
    for mma, style in (("bf16", "-"), ("fp8", "--")):
        if roofs[mma]:
            roof_lines += ax.plot(x, np.minimum(x * ceilings.copy_gbps / 1e3, roofs[mma]), "k", ls=style, lw=1.3,
                                  label=f"{mma.upper()} roof: {ceilings.copy_gbps:.0f} GB/s, {roofs[mma]:.0f} TFLOP/s")
            ax.axvline(roofs[mma] * 1e3 / ceilings.copy_gbps, color="grey", ls=":", lw=1)
    if "fp8" in mmas and not roofs["fp8"]:
        roof_lines += ax.plot([], [], "k--", lw=1.3, label="FP8 roof: not measured here")
    for mma in MMAS:
        sel = [m == mma for m in mmas]
        if any(sel):
            ax.scatter(xs[sel], ys[sel], s=22, color=COLOURS[mma], zorder=3, edgecolor="k", lw=0.4)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="TFLOP/s",
           title=f"roofline, {ceilings.device_name}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(*ax.get_ylim())  # freeze the limits: the labels are placed in display pixels
    _number_points(ax, xs, ys)
    first = ax.legend(handles=roof_lines, fontsize=7, loc="lower right")
    ax.add_artist(first)
    keys = [Line2D([], [], marker="o", ls="", color=COLOURS[m], markeredgecolor="k", markeredgewidth=0.4,
                   label=f"{i}  {lab} ({m})") for i, (lab, m) in enumerate(zip(points["label"], mmas), 1)]
    ax.legend(handles=keys, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
              title="points", title_fontsize=7, frameon=False)
    return ax


def _number_points(ax, xs, ys, fontsize: float = 7.0):
    """Number the points 1..N beside their markers, placed by ``place_labels``."""
    import numpy as np

    if not len(xs):
        return
    fig = ax.figure
    px = ax.transData.transform(np.column_stack([xs, ys]))
    widest = len(str(len(xs)))
    box = (0.65 * fontsize * widest * fig.dpi / 72 + 2, fontsize * 1.2 * fig.dpi / 72)
    offsets = place_labels(px, box, marker_px=0.5 * np.sqrt(22) * fig.dpi / 72 + 1)
    for i, (x, y, off) in enumerate(zip(xs, ys, offsets), 1):
        ax.annotate(str(i), (x, y), xytext=tuple(off * 72 / fig.dpi), textcoords="offset points",
                    ha="center", va="center", fontsize=fontsize)
