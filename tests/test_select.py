"""backends.select: the measured order, the precision rule, the CPU order and clear refusals."""
import json

import pytest
import torch

from labkit import backends, kvpool, preferences


def _case(layout="fp8_per_tensor", heads=4, lens=(40, 17)):
    pool = kvpool.random_pool(1, 256, 16, kv_layout=layout)
    batch = kvpool.batch_for_pool(pool, list(lens))
    qn, _ = kvpool.make_queries(len(lens), heads)
    return qn, pool, batch


def test_cpu_prefers_torch_over_the_interpreter():
    qn, pool, batch = _case()
    for path in backends.PATHS:
        on = kvpool.random_pool(1, 256, 16, kv_dtype="bf16") if path == "bf16_pool" else pool
        assert backends.select(path, qn, on, batch).impl == "torch"


def test_precision_rule_and_errors():
    qn, pool, batch = _case()
    with pytest.raises(ValueError, match=r"precision='exact'; allowed: \['fast', 'accurate'\]"):
        backends.select("fp8_native", qn, pool, batch, precision="exact")
    with pytest.raises(ValueError, match="path='fp4'; allowed"):
        backends.select("fp4", qn, pool, batch)
    assert all(backends.get(n).precision in backends.PRECISIONS for n in backends.names())


def test_table_order_is_followed(tmp_path, monkeypatch):
    table = dict(arch="sm_90", source="test", rows=[dict(
        path="fp8_native", sparse=False, precision="fast", heads=[1, 16], batch=[1, 8],
        order=["triton_q8", "torch"], median_us=[1.0, 2.0])])
    (tmp_path / "sm_90.json").write_text(json.dumps(table))
    assert preferences.order("fp8_native", "sm_90", 4, 2, False, "fast", tmp_path) == (("triton_q8", "torch"), "table")
    # another band, and an unknown GPU: the stated fallback
    assert preferences.order("fp8_native", "sm_90", 64, 2, False, "fast", tmp_path)[1] == "fallback"
    assert preferences.order("fp8_native", "sm_120", 4, 2, False, "fast", tmp_path)[0] == preferences.FALLBACK["fp8_native"]
    assert preferences.order("fp8_native", "cpu", 4, 2, False, "fast", tmp_path)[1] == "cpu"


def test_from_records_ranks_by_time_and_skips_peers():
    import pandas as pd

    df = pd.DataFrame([
        dict(path="fp8_native", impl="a", heads=16, batch=64, topk=0, precision="fast", graph_us=10.0),
        dict(path="fp8_native", impl="b", heads=16, batch=64, topk=0, precision="accurate", graph_us=20.0),
        dict(path="fp8_native", impl="flashinfer", heads=16, batch=64, topk=0, precision="accurate", graph_us=1.0),
    ])
    rows = {r["precision"]: r for r in preferences.from_records(df, "sm_90", "t")["rows"]}
    assert rows["fast"]["order"] == ["a", "b"] and rows["accurate"]["order"] == ["b"]
    assert rows["fast"]["heads"] == [1, 16] and rows["fast"]["batch"] == [9, 1 << 20]


def test_rows_are_kept_per_kv_layout_and_matched_by_it(tmp_path):
    """The same shape measured on two layouts gives two rows; order() takes the pool's layout's row,
    and another layout's row where its own was not measured."""
    import pandas as pd

    rec = dict(path="fp8_native", heads=16, batch=64, topk=2048, precision="fast")
    df = pd.DataFrame([dict(rec, impl="gluon", kv_layout="fp8_per_tensor", graph_us=37.0),
                       dict(rec, impl="rows", kv_layout="fp8_per_tensor", graph_us=70.0),
                       dict(rec, impl="gluon", kv_layout="fp8_ds_mla", graph_us=150.0),
                       dict(rec, impl="rows", kv_layout="fp8_ds_mla", graph_us=120.0)])
    table = preferences.from_records(df, "sm_90", "t")
    assert sorted((r["kv_layout"], tuple(r["order"])) for r in table["rows"]) == [
        ("fp8_ds_mla", ("rows", "gluon")), ("fp8_per_tensor", ("gluon", "rows"))]
    (tmp_path / "sm_90.json").write_text(json.dumps(table))
    order = lambda layout: preferences.order("fp8_native", "sm_90", 16, 64, True, "fast", tmp_path, layout)[0]  # noqa: E731
    assert order("fp8_ds_mla") == ("rows", "gluon") and order("fp8_per_tensor") == ("gluon", "rows")
    assert order("bf16") in {("rows", "gluon"), ("gluon", "rows")}  # not measured: a row of another layout


def test_accurate_follows_the_layouts_precision(tmp_path, monkeypatch):
    """A fast backend that is accurate on one layout (the rows kernel on fp8_ds_mla: bf16 query and
    dots) is an accurate answer there and is passed over, saying why, on the other layout."""
    rec = dict(path="fp8_native", sparse=True, precision="accurate", heads=[1, 16], batch=[1, 8])
    table = dict(arch="sm_90", source="test", rows=[
        dict(rec, kv_layout=k, order=["triton_rows", "torch"], median_us=[1.0, 2.0])
        for k in ("fp8_ds_mla", "fp8_per_tensor")])
    monkeypatch.setattr(preferences, "load", lambda arch, table_dir=None: table)
    monkeypatch.setattr(preferences, "arch_of", lambda device: "sm_90")
    for layout, want in (("fp8_ds_mla", "triton_rows"), ("fp8_per_tensor", "torch")):
        pool = kvpool.random_pool(1, 256, 1, kv_layout=layout)
        batch = kvpool.sparse_batch_for_pool(pool, [40, 17], topk=8)
        qn, _ = kvpool.make_queries(2, 4)
        assert backends.select("fp8_native", qn, pool, batch, precision="accurate").impl == want, layout
        assert backends.select("fp8_native", qn, pool, batch, precision="fast").impl == "triton_rows"
    rows = {r["backend"]: r["precision"] for r in backends.capability_table()}
    assert rows["fp8_native.triton_rows"] == "fast (fp8_ds_mla: accurate)" and rows["fp8_native.torch"] == "accurate"


def test_plan_is_cached_and_runs_each_layer():
    qn, pool, batch = _case()
    b = backends.get("fp8_native.torch")
    p1 = b.plan(pool, batch, qn.shape[1], 1 / 16)
    assert b.plan(pool, batch, qn.shape[1], 1 / 16) is p1
    _, qp = kvpool.make_queries(2, 4)
    assert torch.equal(p1.run(qn, qp, 0), b.decode(qn, qp, pool, 0, batch, 1 / 16))
