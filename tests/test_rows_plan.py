"""The rows kernels planned once per batch (``triton_plans.RowsPlan``, backends ``fp8_native.triton_rows``
and ``triton_rows_acc``): dense and sparse batches, both FP8 layouts, one plan reused across layers
and across calls with new slots. Each layer's output equals the checked launcher's bit for bit
(``mla_decode_fp8_rows``: the same kernels with the same arguments) and lies within its precision's
error of the float64 oracle. CPU shapes are tiny (the interpreter costs 1-3 ms a program); the
``gpu`` tests add split counts above one and CUDA-graph capture (skipped without CUDA).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit import backends, kvpool, reference, triton_plans
from labkit.kernels import mla_decode_fp8_rows as R
from labkit.kernels.launch import SplitKV

SM = 1 / 16
TOL = {"fast": 5e-2, "accurate": 3e-3}  # fast: an e4m3 query (2-3e-2 seen); accurate: the backends' bar
NAMES = {"fast": "fp8_native.triton_rows", "accurate": "fp8_native.triton_rows_acc"}
LAYOUTS = ("fp8_per_tensor", "fp8_ds_mla")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _case(layout, sparse, heads=20, lens=(70, 33), topk=48, device="cpu", pool_tokens=512):
    """Two layers (two k_scales); sparse: page 1, per-layer slots, request 1 padded with -1 (33 < topk)."""
    pool = kvpool.random_pool(2, pool_tokens, 1 if sparse else 16, kv_layout=layout, seed=1, device=device)
    batch = (kvpool.sparse_batch_for_pool(pool, list(lens), topk, seed=2, per_layer=True) if sparse
             else kvpool.batch_for_pool(pool, list(lens), seed=2))
    qn, qp = kvpool.make_queries(len(lens), heads, seed=3, device=device)
    return pool, batch, qn, qp


def _at(batch, layer):
    """The batch as one layer's call sees it (its slots [B, topk] when sparse)."""
    return batch.with_slots(batch.slots(layer)) if batch.topk else batch


def _oracle(pool, batch, qn, qp, layer):
    return reference.mla_decode(qn, qp, pool.dequant(layer, torch.float64), _at(batch, layer), SM)


def _launcher(pool, batch, qn, qp, layer, precision, **kw):
    """The checked launcher on one layer, as the registered backend calls it, plus ``kw``."""
    ds = pool.kv_layout == "fp8_ds_mla"
    common = dict(sm_scale=SM, kv_layout=pool.kv_layout, k_scale=1.0 if ds else pool.scale(layer),
                  precision=precision, **kw)
    if batch.topk:
        return R.mla_decode_fp8_rows(qn, qp, pool.rows(layer), token_indices=batch.slots(layer), **common)
    return R.mla_decode_fp8_rows(qn, qp, pool.rows(layer), kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
                                 kv_lens=batch.kv_lens, page_size=pool.page_size, max_len=batch.max_len, **common)


@pytest.mark.parametrize("precision", ["fast", "accurate"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_plan_equals_the_launcher_and_the_oracle(sparse, layout, precision):
    be = backends.get(NAMES[precision])
    pool, batch, qn, qp = _case(layout, sparse)
    plan = be.plan(pool, batch, qn.shape[1], SM, qn.dtype)
    assert isinstance(plan._run, triton_plans.RowsPlan)
    for layer in (1, 0):
        out = plan.run(qn, qp, layer)
        assert out.shape == qn.shape and out.dtype == qn.dtype
        assert torch.equal(out, _launcher(pool, batch, qn, qp, layer, precision)), layer
        assert reference.rel_err(out, _oracle(pool, batch, qn, qp, layer)) < TOL[precision], layer
    assert torch.equal(be.decode(qn, qp, pool, 0, batch, SM), out)  # decode takes the same plan


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sparse_plan_takes_each_calls_slots(layout):
    """One plan, slots given per call (as an indexer makes them for each layer), not planned."""
    pool, batch, qn, qp = _case(layout, True)
    plan = backends.get(NAMES["accurate"]).plan(pool, batch, qn.shape[1], SM, qn.dtype)
    fresh = kvpool.random_slots(batch, batch.topk, seed=11)  # [B, topk] int32, another draw
    for layer in (0, 1):
        out = plan.run(qn, qp, layer, fresh)
        ref = reference.mla_decode(qn, qp, pool.dequant(layer, torch.float64), batch.with_slots(fresh), SM)
        assert reference.rel_err(out, ref) < TOL["accurate"], layer
        assert reference.rel_err(plan.run(qn, qp, layer), ref) > 0.1  # the batch's own slots: another result


@pytest.mark.parametrize("layout, sparse", [("fp8_ds_mla", False), ("fp8_per_tensor", True)])
def test_plan_with_splits_merges_as_the_launcher(layout, sparse):
    """Three splits: partials and merge from SplitKV (the interpreter's default is one split)."""
    pool, batch, qn, qp = _case(layout, sparse, heads=16, lens=(130, 61), topk=96)
    plan = triton_plans.RowsPlan(pool, batch, 16, SM, qn.dtype, "accurate", num_splits=3)
    assert not plan.split.direct
    part = plan.split.part_o
    for layer in (1, 0):
        out = plan(qn, qp, layer, _at(batch, layer))
        assert torch.equal(out, _launcher(pool, batch, qn, qp, layer, "accurate", num_splits=3)), layer
        assert reference.rel_err(out, _oracle(pool, batch, qn, qp, layer)) < TOL["accurate"]
    assert plan.split.part_o is part


def _refuse(*a, **k):
    raise AssertionError("per-batch work inside a layer's call")


def test_plan_is_made_once_per_batch_and_a_call_only_launches(monkeypatch):
    pool, batch, qn, qp = _case("fp8_per_tensor", True)
    be = backends.get(NAMES["fast"])
    calls, real = [], be.planner
    monkeypatch.setattr(backends, "_PLANS", {})
    object.__setattr__(be, "planner", lambda *a: calls.append(a) or real(*a))
    try:
        plan = be.plan(pool, batch, qn.shape[1], SM, qn.dtype)
        for name in ("rows_config", "check_rows", "check_int32", "check_page_size", "check_heads", "check_query"):
            monkeypatch.setattr(R, name, _refuse)
        for name in ("resolve_splits", "_check_slots"):
            monkeypatch.setattr(triton_plans, name, _refuse)
        monkeypatch.setattr(SplitKV, "make", _refuse)
        outs = [plan.run(qn, qp, layer) for layer in (0, 1, 0)]
        assert be.plan(pool, batch, qn.shape[1], SM, qn.dtype) is plan
        be.decode(qn, qp, pool, 1, batch, SM)
    finally:
        object.__setattr__(be, "planner", real)
    assert len(calls) == 1
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])


def test_plan_refuses_what_the_kernel_cannot_read():
    pool, batch, qn, qp = _case("fp8_per_tensor", True)
    planner = triton_plans.fp8_rows("fast")
    with pytest.raises(ValueError, match="token_indices"):
        planner(pool, batch.with_slots(batch.token_indices.long()), 20, SM, qn.dtype)
    with pytest.raises(ValueError, match="token_indices"):
        planner(pool, batch.with_slots(batch.token_indices.transpose(1, 2)), 20, SM, qn.dtype)
    with pytest.raises(ValueError, match="129 heads"):
        planner(pool, batch, 129, SM, qn.dtype)
    with pytest.raises(ValueError, match="float32"):
        planner(pool, batch, 20, SM, torch.float32)
    dense = kvpool.batch_for_pool(pool, [20])
    with pytest.raises(ValueError, match="kv_lens"):
        planner(pool, dataclasses.replace(dense, kv_lens=dense.kv_lens.long()), 20, SM, qn.dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gpu_plan_equals_the_launcher(sparse, layout, heads):
    """Compiled kernels, the GPU's split counts (above one at a few requests) and query launch."""
    pool, batch, qn, qp = _case(layout, sparse, heads, lens=(1, 4097, 8192), topk=2048, device="cuda",
                                pool_tokens=64 * 400)
    for precision, name in NAMES.items():
        plan = backends.get(name).plan(pool, batch, heads, SM, qn.dtype)
        for layer in (1, 0):
            out = plan.run(qn, qp, layer)
            assert torch.equal(out, _launcher(pool, batch, qn, qp, layer, precision)), (name, layer)
            assert reference.rel_err(out, _oracle(pool, batch, qn, qp, layer)) < TOL[precision], (name, layer)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gpu_plan_replays_in_a_cuda_graph(sparse, layout):
    """Two layers captured once; replayed equal to the eager calls; sparse: new slots written in place
    into the captured slot tensor (a server's way) and the same graph replayed on them."""
    for precision, name in NAMES.items():
        pool, batch, qn, qp = _case(layout, sparse, 64, lens=(3000, 17, 4096), topk=256, device="cuda",
                                    pool_tokens=64 * 300)
        plan = backends.get(name).plan(pool, batch, 64, SM, qn.dtype)
        eager = [plan.run(qn, qp, layer).clone() for layer in (0, 1)]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [plan.run(qn, qp, layer) for layer in (0, 1)]
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for layer, (e, o) in enumerate(zip(eager, outs)):
            assert torch.equal(o, e), (name, layer)
        if sparse:
            batch.token_indices.copy_(kvpool.random_slots(batch, batch.topk, seed=21, num_layers=2))
            graph.replay()
            torch.cuda.synchronize()
            for layer, o in enumerate(outs):
                assert torch.equal(o, _launcher(pool, batch, qn, qp, layer, precision)), (name, layer)
                assert reference.rel_err(o, _oracle(pool, batch, qn, qp, layer)) < TOL[precision], (name, layer)
