"""Pool layout, FP8 round trip, and FlashInfer-style batch construction."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from labkit import kvpool
from labkit.kvpool import E4M3_MAX

# e4m3 has 3 mantissa bits: round-to-nearest error <= 2^-4 relative for normal values; values
# below the smallest normal (2^-6 * k_scale) are spaced 2^-9 * k_scale apart.
E4M3_REL = 2.0**-4
E4M3_ABS_SUB = 2.0**-10


def test_layout_and_views():
    pool = kvpool.random_pool(3, 1024, 16, seed=0)
    assert pool.kv_buffer.shape == (3, 64, 16, 576) and pool.dtype == torch.float8_e4m3fn
    assert pool.ckv(1).shape == (64, 16, 512) and pool.kpe(1).shape == (64, 16, 64)
    assert pool.ckv(1).data_ptr() == pool.layer(1).data_ptr()  # views, not copies
    assert pool.kpe(1).data_ptr() == pool.layer(1).data_ptr() + 512
    assert pool.kv_dtype == "fp8_e4m3" and pool.pool_tokens == 1024


def test_fp8_round_trip_within_e4m3_precision():
    pool, src = kvpool.random_pool(2, 2048, 32, return_source=True, seed=5)
    for i in range(2):
        s = pool.scale(i)
        # the scale matters: real values are nowhere near e4m3's own range
        assert s < 0.05 and src[i].abs().max() == pytest.approx(s * E4M3_MAX, rel=1e-6)
        err = (pool.dequant(i) - src[i]).abs()
        bound = src[i].abs() * E4M3_REL + s * E4M3_ABS_SUB
        assert (err <= bound).all()
        assert not (pool.layer(i).float() == 0).all()
    assert pool.scale(0) != pool.scale(1)


def test_bf16_pool_has_unit_scale():
    pool, src = kvpool.random_pool(1, 256, 16, kv_dtype="bf16", return_source=True)
    assert pool.dtype == torch.bfloat16 and pool.scale(0) == 1.0
    torch.testing.assert_close(pool.dequant(0), src[0], rtol=2**-8, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    page_log=st.integers(0, 7),
    lens=st.lists(st.integers(1, 700), min_size=1, max_size=9),
    seed=st.integers(0, 2**16),
)
def test_batch_pages_ragged_and_scattered(page_log, lens, seed):
    ps = 2**page_log
    need = sum(-(-n // ps) for n in lens)
    num_pages = need + 3 * len(lens) + 5
    b = kvpool.make_batch(num_pages, ps, lens, seed=seed)
    assert b.kv_indptr.dtype == b.kv_indices.dtype == b.kv_last_page_len.dtype == torch.int32
    assert b.kv_indptr[0] == 0 and b.kv_indptr[-1] == need == b.num_pages
    ids = b.kv_indices.tolist()
    assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < num_pages
    for r, n in enumerate(lens):
        npages = int(b.kv_indptr[r + 1] - b.kv_indptr[r])
        assert npages == -(-n // ps)
        assert 1 <= int(b.kv_last_page_len[r]) <= ps
        assert (npages - 1) * ps + int(b.kv_last_page_len[r]) == n == int(b.kv_lens[r])
    assert b.num_tokens == sum(lens)


def test_pages_are_scattered_not_sequential():
    b = kvpool.make_batch(4096, 64, [64 * 100], seed=1)
    ids = b.kv_indices.long()
    assert (ids.diff() == 1).float().mean() < 0.05
    assert b.kv_indices.tolist() != kvpool.make_batch(4096, 64, [64 * 100], seed=2).kv_indices.tolist()


def test_batch_too_big_for_pool():
    with pytest.raises(ValueError, match="need 3 pages of 16 tokens; the pool has 2"):
        kvpool.make_batch(2, 16, [20, 5])


def test_compact_batch_indexes_gathered_buffer():
    pool = kvpool.random_pool(1, 1024, 8, seed=2)
    b = kvpool.batch_for_pool(pool, [9, 17, 1], seed=4)
    gathered = pool.layer(0)[b.kv_indices.long()]
    c = b.compact()
    for r in range(b.batch_size):
        a = pool.layer(0)[b.pages_of(r).long()]
        assert torch.equal(gathered[c.pages_of(r).long()].view(torch.uint8), a.view(torch.uint8))
