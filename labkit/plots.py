"""Plot helpers the notebooks share: a profile breakdown, a sweep with units, the figures of the
measured steps (cast share, speedup, paths, tokens/s), and saving figures.

Every helper draws on ``ax`` when given (else a new figure) and returns the axes.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .results import atomic_write_with

CATEGORY_COLORS = {"cast": "tab:red", "gather": "tab:orange", "attention": "tab:blue",
                   "merge": "tab:purple", "other": "tab:gray"}


FIG_SIZE = (6, 3.6)  # the figures of the measured steps (plot_*)


def _axes(ax=None, size=(6, 3.5)):
    import matplotlib.pyplot as plt

    return ax if ax is not None else plt.subplots(figsize=size)[1]


def profile_bars(profile, ax=None, title: str | None = None):
    """Horizontal bars of ``profile_decode_step``'s rows (the total row left out): ms per category,
    each labelled with its share of the step."""
    ax = _axes(ax)
    rows = profile[profile.category != "total"]
    colors = [CATEGORY_COLORS.get(c, "tab:gray") for c in rows.category]
    ax.barh(rows.category, rows.device_ms, color=colors)
    for y, (ms, share) in enumerate(zip(rows.device_ms, rows.share)):
        ax.annotate(f" {share:.0%}", (ms, y), va="center", fontsize=8)
    activity = profile.attrs.get("activity", "")
    ax.set_xlabel(f"time per decode step (ms, {activity} activity)" if activity else "time per decode step (ms)")
    ax.invert_yaxis()  # cast on top, in pipeline order
    if title:
        ax.set_title(title)
    return ax


def sweep_lines(df, x: str, y: str, hue: str = "path", ax=None, xlabel: str | None = None,
                ylabel: str | None = None, logx: bool = False, logy: bool = False, title: str | None = None):
    """One line per value of ``hue``: ``y`` against ``x``, markers at the measured points.

    Give units in the labels (``"pool tokens"``, ``"time per layer (us)"``); they default to the
    column names.
    """
    ax = _axes(ax)
    for key, g in df.sort_values(x).groupby(hue, sort=False):
        ax.plot(g[x], g[y], marker="o", ms=3, label=str(key))
    ax.set(xlabel=xlabel or x, ylabel=ylabel or y)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def savefig(fig, run_dir, name: str, dpi: int = 120) -> tuple[Path, Path]:
    """Write ``<run_dir>/<name>.png`` and ``.svg`` atomically (replacing earlier ones); returns both paths."""
    run_dir = Path(run_dir)
    out = []
    for fmt in ("png", "svg"):
        path = run_dir / f"{name}.{fmt}"
        out.append(atomic_write_with(path, lambda tmp, f=fmt: fig.savefig(tmp, format=f, dpi=dpi,
                                                                           bbox_inches="tight")))
    return tuple(out)


def plot_cast_share(sw: pd.DataFrame, ax=None):
    """Cast and attention ms per layer against pool size, with the cast's share on the right."""
    ax = _axes(ax, FIG_SIZE)
    ax.plot(sw.pool_tokens, sw.cast_ms, "o-", label="cast")
    ax.plot(sw.pool_tokens, sw.attention_ms, "s-", label="attention")
    ax.set(xscale="log", yscale="log", xlabel="pool tokens per layer", ylabel="ms per layer (profiled)")
    right = ax.twinx()
    right.plot(sw.pool_tokens, 100 * sw.cast_share, "k:", label="cast share")
    right.set(ylabel="cast share of the layer (%)", ylim=(0, 100))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"the cast grows with the pool ({sw.tokens_read.iloc[0]:,} tokens read)")
    return ax


def plot_speedup(sp: pd.DataFrame, x: str, xlabel: str, ax=None, logx: bool = False):
    """gather_cast's speedup over full_pool_cast against ``x``; 1 = break-even."""
    ax = _axes(ax, FIG_SIZE)
    ax.plot(sp[x], sp.speedup, "o-")
    ax.axhline(1, color="grey", ls=":")
    ax.set(xlabel=xlabel, ylabel="speedup of gather_cast (x)", title="gather-then-cast against the whole-pool cast")
    if logx:
        ax.set_xscale("log")
    return ax


def plot_paths(paths: pd.DataFrame, ax=None):
    """One layer's device time per backend, labelled with the time a call takes and % of the roofline."""
    ax = _axes(ax, FIG_SIZE)
    dev, call = paths.device_ms * 1e3, paths.median_ms * 1e3
    ax.barh(paths.backend, dev, color="tab:blue")
    pct = paths.pct_roofline if "pct_roofline" in paths else [float("nan")] * len(paths)
    for y, (d, c, r) in enumerate(zip(dev, call, pct)):
        label = f" {d:,.0f} us ({c:,.0f} a call)" + ("" if r != r else f", {r:.0f}% of roofline")
        ax.annotate(label, (d, y), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="device time per layer (us, profiled kernels)", ylabel="backend",
           title=f"{paths.batch_size.iloc[0]} x {paths.context_len.iloc[0]:,} tokens, pool {paths.pool_tokens.max():,}")
    ax.set_xlim(0, dev.max() * 1.8)
    return ax


def plot_tok_s(steps: pd.DataFrame, ax=None):
    """Modelled tokens/s per path beside the seed's measured figures."""
    import numpy as np

    ax = _axes(ax, FIG_SIZE)
    x = np.arange(len(steps))
    ax.bar(x - 0.2, steps.tok_s, 0.4, label="this lab (decode-step model)")
    ax.bar(x + 0.2, steps.seed_tok_s.astype(float).fillna(0), 0.4, label="seed (measured)")
    many = steps.run.nunique() > 1
    ax.set_xticks(x, [f"{p}\n{d}" if many else p for p, d in zip(steps.path, steps.device)], fontsize=8)
    ax.set(xlabel="decode path", ylabel="tokens/s, one stream",
           title=f"decode step: {steps.layers.iloc[0]} layers on {steps.device.iloc[0]} + the seed's rest")
    ax.legend(fontsize=8)
    return ax
