"""Plot helpers the notebooks share: a profile breakdown, a sweep with units, and saving figures.

Every helper draws on ``ax`` when given (else a new figure) and returns the axes.
"""
from __future__ import annotations

from pathlib import Path

from .results import atomic_write_with

CATEGORY_COLORS = {"cast": "tab:red", "gather": "tab:orange", "attention": "tab:blue",
                   "merge": "tab:purple", "other": "tab:gray"}


def _axes(ax, size=(6, 3.5)):
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
