"""Every Triton, Gluon and FlashInfer backend can be captured in a CUDA graph, on a BF16 and an FP8
pool, dense and sparse: planned once eagerly, captured over two layers, replayed, and equal to the
eager output (the torch reference paths may sync: they are not captured). GPU only."""
import pytest
import torch

from labkit import backends, kvpool, reference

SM = 1 / 16
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cases():
    for layout in ("fp8_per_tensor", "bf16", "fp8_ds_mla"):
        for sparse in (False, True):
            yield layout, sparse


def _setup(layout, sparse):
    page = 1 if sparse else 64
    pool = kvpool.random_pool(2, 64 * 300, page, kv_layout=layout, device="cuda", seed=2)
    lens = [3000, 17, 4096, 64]
    batch = (kvpool.sparse_batch_for_pool(pool, lens, 256, seed=3, per_layer=True) if sparse
             else kvpool.batch_for_pool(pool, lens, seed=3))
    qn, qp = kvpool.make_queries(len(lens), 16, device="cuda", seed=4)
    return pool, batch, qn, qp


@pytest.mark.parametrize("layout, sparse", list(_cases()))
def test_every_backend_captures_in_a_cuda_graph(layout, sparse):
    pool, batch, qn, qp = _setup(layout, sparse)
    captured = []
    for name in backends.names():
        b = backends.get(name)
        if b.impl == "torch":
            continue
        try:
            b.check(qn, pool, batch)
        except ValueError:
            continue
        plan = b.plan(pool, batch, qn.shape[1], SM, qn.dtype)
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
            ref = reference.mla_decode(qn, qp, pool.dequant(layer, torch.float64),
                                       batch.with_slots(batch.slots(layer)) if sparse else batch, SM)
            assert reference.rel_err(e, ref) < 6e-2, (name, layer)
            # the same launches replayed: equal up to the order of any atomic reductions
            assert reference.rel_err(o, e) < (1e-3 if b.impl == "flashinfer" else 1e-6), name
        captured.append(name)
    assert captured, "no backend allowed this call"
    if layout != "bf16":  # the rows kernels (planned) read both FP8 layouts, dense and sparse
        assert {"fp8_native.triton_rows", "fp8_native.triton_rows_acc"} <= set(captured), captured
