"""The JupyterLab explorer re-plots stored records; no kernel runs behind it."""
import matplotlib

matplotlib.use("agg")
import pandas as pd  # noqa: E402

from labkit import explore  # noqa: E402


def _records():
    rows = []
    for h in (8, 16, 64):
        for b, t in (("fp8_native.triton", 0.1 * h), ("bf16_pool.triton", 0.2 * h)):
            rows.append(dict(experiment="heads_sweep", backend=b, heads=h, device_ms=t))
    for c in (1024, 4096):
        rows.append(dict(experiment="context_sweep", backend="fp8_native.triton", context_len=c, device_ms=c / 1e4))
    for p in (32768, 65536, 131072):
        rows.append(dict(experiment="pool_sweep", backend="full_pool_cast.triton", pool_tokens=p, device_ms=p / 1e5))
    return pd.DataFrame(rows)


def test_choices_are_the_measured_values():
    assert explore.choices(_records()) == dict(heads=[8, 16, 64], context_len=[1024, 4096],
                                               pool_tokens=[32768, 65536, 131072])


def test_plot_marks_the_chosen_points():
    fig = explore.plot_point(_records(), heads=16, context_len=4096, pool_tokens=65536)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    # fp8 at 16 heads: 1.6 ms -> 1600 us; bf16: 3200 us; context 4096: 410 us; pool 65536: 655 us
    assert {"1600 us", "3200 us", "410 us", "655 us"} <= set(notes)
    assert [ax.get_xlabel() for ax in fig.axes] == ["heads per GPU", "tokens per request", "pool tokens per layer"]


def test_missing_sweep_is_said_not_drawn():
    fig = explore.plot_point(_records().query("experiment != 'pool_sweep'"), heads=8)
    assert fig.axes[2].get_title() == "no pool_sweep records"


def test_explorer_has_one_slider_per_stored_sweep():
    box = explore.explorer(_records())
    sliders = box.children[0].children
    assert [s.description for s in sliders] == ["heads", "context_len", "pool_tokens"]
    assert list(sliders[0].options) == [8, 16, 64] and sliders[0].value == 16
