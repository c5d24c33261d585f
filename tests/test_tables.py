"""labkit.tables.against_flashinfer: our fastest kernel per precision beside FlashInfer's BF16 one."""
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
