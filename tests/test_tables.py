"""labkit.tables.against_flashinfer (our fastest kernel per precision beside FlashInfer's BF16 one) and
against_targets (that table against data/targets.json), and `labkit targets`."""
import pandas as pd
import pytest

from labkit import tables


def _rec(impl, path, precision, us, heads=64, shape="heads", topk=0, rel_err=1e-3, layout="fp8_per_tensor"):
    return dict(shape=shape, heads=heads, batch=64, ctx=8192, topk=topk, kv_layout=layout, impl=impl, path=path,
                precision=precision, graph_us=us, rel_err=rel_err)


def test_against_flashinfer_picks_fastest_per_precision_and_ratios():
    recs = pd.DataFrame([
        _rec("flashinfer", "bf16_pool", "accurate", 200.0, layout="bf16"),
        _rec("flashinfer", "fp8_native", "accurate", 400.0),  # FlashInfer's FP8 pool is not ours
        _rec("gluon", "fp8_native", "fast", 160.0, rel_err=2.8e-2),
        _rec("triton_q8", "fp8_native", "fast", 250.0, rel_err=2.5e-2),
        _rec("gluon_acc", "fp8_native", "accurate", 250.0, rel_err=2.6e-3),
        _rec("triton", "bf16_pool", "accurate", 100.0, layout="bf16"),  # not fp8_native: left out
        _rec("gluon", "fp8_native", "fast", float("nan")),  # not measured: left out
        _rec("gluon", "fp8_native", "fast", 50.0, heads=16),  # no FlashInfer row at 16 heads: left out
    ])
    t = tables.against_flashinfer(recs)
    assert len(t) == 1
    r = t.iloc[0]
    assert (r.heads, r.flashinfer_bf16, r.fast, r.fast_impl, r.accurate, r.accurate_impl) == \
        (64, 200.0, 160.0, "gluon", 250.0, "gluon_acc")
    assert r["fi/fast"] == pytest.approx(1.25) and r["fi/accurate"] == pytest.approx(0.8)
    assert r.fast_rel_err == pytest.approx(2.8e-2)


def test_against_flashinfer_keeps_dense_and_sparse_apart():
    recs = pd.DataFrame([
        _rec("flashinfer", "bf16_pool", "accurate", 200.0, layout="bf16"),
        _rec("flashinfer", "bf16_pool", "accurate", 80.0, shape="sparse", topk=2048, layout="bf16"),
        _rec("gluon", "fp8_native", "fast", 160.0),
        _rec("gluon", "fp8_native", "fast", 100.0, shape="sparse", topk=2048),
    ])
    t = tables.against_flashinfer(recs).set_index("topk")
    assert t.loc[0, "fi/fast"] == pytest.approx(1.25) and t.loc[2048, "fi/fast"] == pytest.approx(0.8)
    assert "accurate" not in t


def _fi_table(fi, fast, accurate, acc_err=2e-3, heads=16, batch=64, ctx=8192, topk=0):
    return pd.DataFrame([dict(shape="mem", heads=heads, batch=batch, ctx=ctx, topk=topk, kv_layout="fp8_per_tensor",
                              flashinfer_bf16=fi, fast=fast, fast_impl="gluon", fast_rel_err=2.8e-2,
                              accurate=accurate, accurate_impl="gluon_acc", accurate_rel_err=acc_err)])


TARGETS = dict(fi_tolerance=0.10, max_rel_err=dict(accurate=3e-3),
               rows=[dict(heads=16, batch=64, ctx=8192, topk=0, flashinfer_bf16=150, fast=80, accurate=95),
                     dict(heads=64, batch=1, ctx=8192, topk=0, flashinfer_bf16=25, fast=15, accurate=20)])


def test_against_targets_counts_microseconds_while_flashinfer_matches():
    t = tables.against_targets(_fi_table(fi=160.0, fast=79.0, accurate=96.0), TARGETS).set_index("precision")
    assert list(t.index) == ["fast", "accurate"]  # the 64-head target is not in the run: left out
    assert t.loc["fast", "counts"] == "us" and t.loc["fast", "fi_drift"] == pytest.approx(160 / 150 - 1)
    assert t.loc["fast", "met"] and not t.loc["accurate", "met"]  # 79 <= 80; 96 > 95 though 160/96 > 150/95
    assert t.loc["accurate", "needed"] == pytest.approx(150 / 95) and t.loc["accurate", "reached"] == pytest.approx(160 / 96)


def test_against_targets_counts_the_ratio_where_flashinfer_drifts():
    t = tables.against_targets(_fi_table(fi=200.0, fast=105.0, accurate=125.0), TARGETS).set_index("precision")
    assert (t.counts == "ratio").all()
    assert t.loc["fast", "met"]  # 200 / 105 = 1.90 >= 150 / 80 = 1.875, though 105 us > 80
    assert t.loc["accurate", "met"]  # 200 / 125 = 1.60 >= 150 / 95 = 1.58
    t = tables.against_targets(_fi_table(fi=200.0, fast=110.0, accurate=130.0), TARGETS).set_index("precision")
    assert not t.loc["fast", "met"] and not t.loc["accurate", "met"]  # 1.82 < 1.875; 1.54 < 1.58


def test_against_targets_needs_the_accurate_error():
    t = tables.against_targets(_fi_table(fi=150.0, fast=70.0, accurate=90.0, acc_err=3.5e-3), TARGETS)
    assert t.set_index("precision").met.to_dict() == {"fast": True, "accurate": False}


def test_the_committed_targets_are_issue_16s():
    rows = tables.load_targets()["rows"]
    assert len(rows) == 9 and all(r["fast"] < r["flashinfer_bf16"] and r["fast"] <= r["accurate"] for r in rows)
    by = {(r["heads"], r["batch"], r["topk"]): (r["flashinfer_bf16"], r["fast"], r["accurate"]) for r in rows}
    assert by[(128, 128, 2048)] == (143, 95, 140) and by[(16, 64, 0)] == (150, 80, 95)


def test_labkit_targets_command(tmp_path, capsys):
    from labkit import cli
    recs = pd.DataFrame([_rec("flashinfer", "bf16_pool", "accurate", 150.0, heads=16, layout="bf16"),
                         _rec("gluon", "fp8_native", "fast", 79.0, heads=16, rel_err=2.8e-2)])
    recs.to_parquet(tmp_path / "bench.parquet")
    assert cli.main(["targets", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 met" in out and "gluon" in out
    assert cli.main(["targets", str(tmp_path / "nope")]) == 2
    assert "records=" in capsys.readouterr().err


def _sparse(impl, precision, us, layout, heads=64, rel_err=1e-3):
    return _rec(impl, "fp8_native", precision, us, heads=heads, shape="sparse", topk=2048, rel_err=rel_err,
                layout=layout)


def test_layout_gap_compares_each_precisions_fastest_on_both_layouts():
    recs = pd.DataFrame([
        _sparse("gluon", "fast", 60.0, "fp8_per_tensor"), _sparse("triton_rows", "fast", 100.0, "fp8_per_tensor"),
        _sparse("gluon", "fast", 65.0, "fp8_ds_mla"),  # 65 / 60 = 1.083: within 10%
        _sparse("gluon_acc", "accurate", 100.0, "fp8_per_tensor"), _sparse("gluon_acc", "accurate", 137.0, "fp8_ds_mla"),
        _sparse("triton_rows", "accurate", 126.0, "fp8_ds_mla"),  # the faster accurate one on ds: 1.26
        _sparse("gluon", "fast", 30.0, "fp8_per_tensor", heads=16),  # one layout only: left out
        _rec("flashinfer", "fp8_native", "accurate", 10.0, shape="sparse", topk=2048),  # a peer: left out
        _rec("gluon", "fp8_native", "fast", 10.0),  # dense: left out
    ])
    g = tables.layout_gap(recs, within=0.10).set_index("precision")
    assert list(g.index) == ["fast", "accurate"] and (g.heads == 64).all()
    assert g.loc["fast", "ratio"] == pytest.approx(65 / 60) and g.loc["fast", "met"]
    assert (g.loc["accurate", "ds_mla_impl"], g.loc["accurate", "ratio"]) == ("triton_rows", pytest.approx(1.26))
    assert not g.loc["accurate", "met"]
    assert tables.layout_gap(recs, within=0.30).met.all()


def test_labkit_targets_prints_the_layout_gap_without_flashinfer(tmp_path, capsys):
    from labkit import cli
    pd.DataFrame([_sparse("gluon", "fast", 50.0, "fp8_per_tensor"), _sparse("gluon", "fast", 80.0, "fp8_ds_mla")]
                 ).to_parquet(tmp_path / "bench.parquet")
    assert cli.main(["targets", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 met" in out and "1.6" in out and "against FlashInfer" not in out
