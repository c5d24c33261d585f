"""The three KV layouts: byte counts, round trips and the ds_mla group scales against plain math."""
import pytest
import torch

from labkit import kvlayout, kvpool


def test_bytes_per_token():
    assert kvlayout.KV_LAYOUTS == {"bf16": 1152, "fp8_per_tensor": 576, "fp8_ds_mla": 656}
    for layout, nbytes in kvlayout.KV_LAYOUTS.items():
        pool = kvpool.random_pool(1, 32, 16, kv_layout=layout)
        assert pool.bytes_per_token == nbytes
        assert pool.layer(0)[0, 0].numel() * pool.kv_buffer.element_size() == nbytes
        assert pool.kv_dim == 576


def test_ds_mla_round_trip_matches_group_math():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 7, 576, generator=g) * torch.tensor([0.01, 1.0, 30.0, 2.0] * 144)).double()
    x = x.float().double()  # float32-representable values: no double rounding in the reference
    packed = kvlayout.quantize_ds_mla(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, 656)
    # independent reference: per 128-value group, scale = 2^ceil(log2(amax / 448)), e4m3 rounding
    nope = x[..., :512].reshape(5, 7, 4, 128)
    amax = nope.abs().amax(-1)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    want = (nope / scale[..., None]).to(torch.float8_e4m3fn).double() * scale[..., None]
    got = kvlayout.dequant_ds_mla(packed, torch.float64)
    assert torch.equal(got[..., :512], want.reshape(5, 7, 512))
    assert torch.equal(kvlayout.ds_scales(packed).double(), scale)
    assert torch.equal(got[..., 512:], x[..., 512:].to(torch.bfloat16).double())
    # a power-of-two scale never overflows e4m3: half a step of 3 mantissa bits, or of the subnormals
    err = (got[..., :512] - x[..., :512]).reshape(5, 7, 4, 128).abs()
    assert (err <= nope.abs() / 16 + scale[..., None] * 2.0**-10).all()


def test_pool_rejects_mismatched_buffer_and_ds_scale():
    buf = torch.zeros(1, 2, 4, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_layout='fp8_ds_mla' stores torch.uint8"):
        kvpool.KVPool(buf, torch.ones(1), 512, "fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_layout='fp9'; allowed"):
        kvpool.KVPool(buf, torch.ones(1), 512, "fp9")
    pool = kvpool.random_pool(1, 32, 16, kv_layout="fp8_ds_mla")
    with pytest.raises(ValueError, match="scale per 128 values"):
        pool.scale(0)


def test_rows_are_token_ids():
    pool = kvpool.random_pool(1, 64, 16)
    rows = pool.rows(0)
    assert rows.shape == (64, 576)
    assert torch.equal(rows[3 * 16 + 5].view(torch.uint8), pool.layer(0)[3, 5].view(torch.uint8))
