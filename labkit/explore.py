"""Explore stored results in JupyterLab: move heads per GPU, context length and pool size and
re-plot from the records a run already wrote (no kernel runs).

    from labkit import explore
    explore.explorer(results.load_runs(run_dir))     # a widget; in JupyterLab only

``plot_point`` draws the same figure without widgets (tested; used by the widget on each change).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

SWEEPS = {  # control -> (experiment, column)
    "heads": ("heads_sweep", "heads"),
    "context_len": ("context_sweep", "context_len"),
    "pool_tokens": ("pool_sweep", "pool_tokens"),
}


def _sweep(records: pd.DataFrame, control: str) -> pd.DataFrame:
    exp, col = SWEEPS[control]
    if "experiment" not in records:
        return records.iloc[:0]
    df = records[records.experiment == exp].dropna(subset=[col, "device_ms"])
    return df.sort_values(col)


def choices(records: pd.DataFrame) -> dict:
    """The values each control can take: those the stored sweeps measured."""
    return {c: sorted(int(v) for v in _sweep(records, c)[SWEEPS[c][1]].unique()) for c in SWEEPS}


def plot_point(records: pd.DataFrame, heads=None, context_len=None, pool_tokens=None):
    """Three panels of per-layer device time (us) against heads, context and pool size, one line
    per backend, the chosen value of each marked. Returns the figure."""
    chosen = dict(heads=heads, context_len=context_len, pool_tokens=pool_tokens)
    labels = dict(heads="heads per GPU", context_len="tokens per request", pool_tokens="pool tokens per layer")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, control in zip(axes, SWEEPS):
        df, col = _sweep(records, control), SWEEPS[control][1]
        if df.empty:
            ax.set_title(f"no {SWEEPS[control][0]} records")
            ax.axis("off")
            continue
        for backend, g in df.groupby("backend"):
            g = g.groupby(col, as_index=False).device_ms.median()
            line, = ax.plot(g[col], g.device_ms * 1e3, marker="o", ms=3, label=backend)
            at = g[g[col] == chosen[control]]
            if not at.empty:
                y = float(at.device_ms.iloc[0]) * 1e3
                ax.plot([chosen[control]], [y], "o", ms=9, mfc="none", color=line.get_color())
                ax.annotate(f"{y:.0f} us", (chosen[control], y), textcoords="offset points", xytext=(6, 4),
                            fontsize=8, color=line.get_color())
        if chosen[control] is not None:
            ax.axvline(chosen[control], color="0.6", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(labels[control])
        ax.set_ylabel("device time per layer (us)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def explorer(records: pd.DataFrame):
    """Sliders over the stored sweeps and the figure of ``plot_point``, re-drawn on each move."""
    import ipywidgets as w
    from IPython.display import display

    opts = choices(records)
    sliders = {c: w.SelectionSlider(options=v, value=v[len(v) // 2], description=c, continuous_update=False)
               for c, v in opts.items() if v}
    out = w.Output()

    def redraw(_=None):
        with out:
            out.clear_output(wait=True)
            fig = plot_point(records, **{c: s.value for c, s in sliders.items()})
            display(fig)
            plt.close(fig)

    for s in sliders.values():
        s.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox(list(sliders.values())), out])
