"""labkit.mma_model: the aligned-accumulation step against hand-worked sums, its MMA against
float64 matmuls, and the modelled accurate decode against the float64 oracle."""
import pytest
import torch

from labkit import kvpool, mma_model as M, reference


def test_aligned_sum_truncates_toward_zero_below_the_largest_term():
    t = torch.tensor([[1.0, 2.0 ** -20, 3 * 2.0 ** -15], [-1.0, -1.5 * 2.0 ** -14, 2.0 ** -13]], dtype=torch.float64)
    # ulp = 2^(0 - 13): 2^-20 and 0.375 ulp vanish; -0.75 ulp truncates to 0, +1 ulp stays
    assert M.aligned_sum(t, 13).tolist() == [1.0, -1.0 + 2.0 ** -13]
    exact = t.sum(-1).float().double()
    assert torch.equal(M.aligned_sum(t, None), exact) and M.aligned_sum(t, 30).tolist() == exact.tolist()


def test_mma_is_a_matmul_up_to_its_accumulator():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 96, generator=g, dtype=torch.float64), torch.randn(3, 96, 5, generator=g, dtype=torch.float64)
    acc = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    want = acc + a @ b
    assert torch.allclose(M.mma(acc, a, b, None), want, rtol=1e-6, atol=1e-6)  # fp32 rounding per k-step
    err13 = (M.mma(acc, a, b, 13) - want).abs().max()
    top = acc.abs().max() + (a.abs() @ b.abs()).max()  # no term or partial sum exceeds it
    assert 1e-6 < err13 < 3 * 33 * 2.0 ** -13 * top  # 3 steps of 33 terms, each cut by under one ulp


@pytest.fixture(scope="module")
def case():
    B, H, L = 2, 8, 1024
    pool = kvpool.random_pool(1, B * L + 64, 64, seed=1)
    batch = kvpool.batch_for_pool(pool, [L] * B, seed=2)
    qn, qp = kvpool.make_queries(B, H, seed=3)
    real = pool.dequant(0, torch.float64)
    kv = torch.stack([real[batch.kv_indices[batch.kv_indptr[b]:batch.kv_indptr[b + 1]].long()].reshape(-1, 576)[:L]
                      for b in range(B)])
    ref = reference.mla_decode(qn, qp, real, batch, 1 / 16)
    return torch.cat([qn, qp], -1).double(), kv, ref


def test_exact_accumulation_leaves_the_split_terms_error(case):
    q, kv, ref = case
    errs = [reference.rel_err(M.decode(q, kv, chain, None), ref) for chain in (256, 1024)]
    assert all(2e-4 < e < 1.2e-3 for e in errs)  # q and p as two e4m3 terms each: ~6.5e-4
    assert errs[1] == pytest.approx(errs[0], rel=0.2)  # independent of the split length


def test_narrow_accumulation_grows_with_the_split_and_promotion_stops_it(case):
    q, kv, ref = case
    exact = reference.rel_err(M.decode(q, kv, 1024, None), ref)
    short, long_ = (reference.rel_err(M.decode(q, kv, chain, 13), ref) for chain in (128, 1024))
    promoted = reference.rel_err(M.decode(q, kv, 1024, 13, promote=True), ref)
    assert exact < short < long_ and promoted < long_
