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


@dataclass
class Ceilings:
    """What the device can do, measured: copy bandwidth (read + write counted) and matmul rate."""

    copy_gbps: float
    matmul_tflops: float
    device_name: str
    method: str


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
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    method = (f"median {t_copy.method}: {copy_bytes / 2**30:g} GiB copy (read+write), "
              f"{matmul_n}^3 {str(dtype).removeprefix('torch.')} random matmul")
    return Ceilings(2 * copy_bytes / t_copy.median_ms / 1e6, 2 * matmul_n**3 / t_mm.median_ms / 1e9,
                    name, ("CPU " if not cuda else "") + method)


def measure_ceilings(device="cuda", cache_dir=None, copy_bytes: int | None = None,
                     matmul_n: int | None = None) -> Ceilings:
    """Measure once and cache as ``<cache_dir>/ceilings-<device>.json`` (the run folder).

    CUDA: 2 GiB device-to-device copy, 8192^3 BF16 matmul. CPU: 64 MiB copy, 1024^3 FP32 matmul,
    labelled CPU in ``device_name`` and ``method``.
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


def achieved(path: str, time_ms: float, ceilings: Ceilings, **shape) -> dict:
    """Achieved rates of one layer of ``path`` taking ``time_ms``, against the ceilings.

    ``shape``: pool_tokens, tokens_read, heads, batch, kv_dtype, d_ckv, d_kpe, kv_layout (as path_bytes).
    Percentages are 0..100. ``roofline_ms`` = max(bytes / copy bandwidth, FLOPs / matmul rate);
    ``bound`` names the larger term; ``pct_roofline`` = roofline_ms / time_ms * 100.
    """
    nbytes = path_bytes(path, **shape)
    flops = path_flops(shape.get("heads", 0), shape["tokens_read"],
                       shape.get("d_ckv", 512), shape.get("d_kpe", 64))
    mem_ms = nbytes / (ceilings.copy_gbps * 1e6)
    math_ms = flops / (ceilings.matmul_tflops * 1e9)
    gbps, tflops = nbytes / time_ms / 1e6, flops / time_ms / 1e9
    roof = max(mem_ms, math_ms)
    return dict(bytes=nbytes, flops=flops, intensity=flops / nbytes, gbps=gbps, tflops=tflops,
                pct_bandwidth=100 * gbps / ceilings.copy_gbps, pct_compute=100 * tflops / ceilings.matmul_tflops,
                bound="memory" if mem_ms >= math_ms else "compute", pct_roofline=100 * roof / time_ms,
                roofline_ms=roof)


def plot_roofline(points, ceilings: Ceilings, ax=None):
    """Log-log roofline: attainable TFLOP/s against intensity (FLOP/B), one marker per row of
    ``points`` (columns label, intensity, tflops). Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ridge = ceilings.matmul_tflops * 1e3 / ceilings.copy_gbps  # FLOP/B where the roofs meet
    lo = min([ridge / 100] + [float(x) / 2 for x in points["intensity"]])
    hi = max([ridge * 100] + [float(x) * 2 for x in points["intensity"]])
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(x * ceilings.copy_gbps / 1e3, ceilings.matmul_tflops), "k-", lw=1.5,
            label=f"roof: {ceilings.copy_gbps:.0f} GB/s, {ceilings.matmul_tflops:.0f} TFLOP/s")
    for _, r in points.iterrows():
        ax.scatter(r["intensity"], r["tflops"], zorder=3)
        ax.annotate(str(r["label"]), (r["intensity"], r["tflops"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="TFLOP/s",
           title=f"roofline, {ceilings.device_name}")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.legend(fontsize=8, loc="lower right")
    return ax
