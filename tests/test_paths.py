"""The torch decode paths against the fp64 oracle, and the backend registry's rules."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from labkit import backends, kvpool, reference

TORCH_PATHS = ["full_pool_cast.torch", "gather_cast.torch", "fp8_native.torch"]
# Output is rounded to bf16 (8 bits of mantissa): relative error ~2^-9 per element; the fp32
# arithmetic inside adds far less. Against the unquantized data e4m3 rounding (~2^-5 rms per
# value) dominates.
TOL_DEQUANT = 4e-3
TOL_SOURCE = 6e-2


def _case(page_size, lens, heads, seed):
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 4)
    pool, src = kvpool.random_pool(2, ptok, page_size, return_source=True, seed=seed)
    batch = kvpool.batch_for_pool(pool, lens, seed=seed + 1)
    q_nope, q_pe = kvpool.make_queries(len(lens), heads, seed=seed + 2)
    return pool, src, batch, q_nope, q_pe


@settings(max_examples=12, deadline=None)
@given(
    page_log=st.integers(0, 7),
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    heads=st.sampled_from([1, 3, 16, 128]),
    seed=st.integers(0, 1000),
)
def test_torch_paths_match_oracle(page_log, lens, heads, seed):
    pool, src, batch, q_nope, q_pe = _case(2**page_log, lens, heads, seed)
    layer, sm = 1, 1 / 16
    ref, lse = reference.mla_decode(q_nope, q_pe, pool.dequant(layer, torch.float64), batch, sm, return_lse=True)
    ref_src = reference.mla_decode(q_nope, q_pe, src[layer], batch, sm)
    assert torch.isfinite(lse).all()
    for name in TORCH_PATHS:
        out = backends.get(name).decode(q_nope, q_pe, pool, layer, batch, sm)
        assert out.shape == q_nope.shape and out.dtype == torch.bfloat16
        assert reference.rel_err(out, ref) < TOL_DEQUANT, name
        assert reference.rel_err(out, ref_src) < TOL_SOURCE, name


def test_scale_is_applied():
    """Dropping k_scale would be far off: the oracle on raw codes disagrees with every path."""
    pool, _, batch, qn, qp = _case(16, [200, 33], 8, 0)
    raw = reference.mla_decode(qn, qp, pool.layer(0).double(), batch, 1 / 16)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, 1 / 16)
    out = backends.get("fp8_native.torch").decode(qn, qp, pool, 0, batch, 1 / 16)
    assert reference.rel_err(raw, ref) > 0.3 and reference.rel_err(out, ref) < TOL_DEQUANT


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_gather_cast_equals_full_pool_cast_bit_for_bit(page_size):
    pool, _, batch, qn, qp = _case(page_size, [1, page_size - 1 or 1, page_size + 1, 257], 16, page_size)
    a = backends.get("full_pool_cast.torch").decode(qn, qp, pool, 0, batch, 1 / 16)
    b = backends.get("gather_cast.torch").decode(qn, qp, pool, 0, batch, 1 / 16)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_bf16_kernel_refuses_fp8_before_launch():
    pool, _, batch, qn, qp = _case(16, [40], 4, 0)
    with pytest.raises(ValueError, match=r"bf16_pool\.torch.*\['bf16'\].*float8_e4m3fn.*fp8_native"):
        backends.get("bf16_pool.torch").decode(qn, qp, pool, 0, batch, 1 / 16)


def test_bf16_pool_path_matches_oracle():
    pool = kvpool.random_pool(1, 512, 32, kv_dtype="bf16", seed=3)
    batch = kvpool.batch_for_pool(pool, [100, 7], seed=1)
    qn, qp = kvpool.make_queries(2, 8)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, 1 / 16)
    out = backends.get("bf16_pool.torch").decode(qn, qp, pool, 0, batch, 1 / 16)
    assert reference.rel_err(out, ref) < TOL_DEQUANT


def test_registry_lookup_and_errors():
    assert backends.get("fp8_native", device="cpu").path == "fp8_native"
    with pytest.raises(ValueError, match="unknown.*allowed"):
        backends.get("flash_fp4")
    rows = backends.capability_table()
    by = {r["backend"]: r for r in rows}
    assert by["fp8_native.torch"]["kv_layouts"] == "fp8_per_tensor,fp8_ds_mla"
    assert by["bf16_pool.torch"]["kv_layouts"] == "bf16"
    assert by["fp8_native.triton_q8"]["precision"] == "fast"
    assert by["full_pool_cast.torch"]["precision"] == "accurate"


def test_too_many_heads_refused():
    pool, _, batch, _, _ = _case(16, [10], 1, 0)
    qn, qp = kvpool.make_queries(1, 129)
    with pytest.raises(ValueError, match="129 heads; allowed 1..128"):
        backends.get("gather_cast.torch").decode(qn, qp, pool, 0, batch, 1 / 16)
