"""FlashInfer peers: listed with a reason when absent; on a GPU with FlashInfer, checked against the oracle."""
import importlib.util

import pytest
import torch

from labkit import backends, kvpool, reference

HAS_FI = importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(HAS_FI, reason="flashinfer is installed here")
def test_absent_flashinfer_is_listed_with_reason():
    rows = {r["backend"]: r for r in backends.capability_table()}
    for name, path in [("flashinfer_mla", "full_pool_cast"), ("flashinfer_mla_fp8", "fp8_native")]:
        assert rows[name]["available"] is False and rows[name]["path"] == path
        assert "flashinfer" in rows[name]["note"]
        with pytest.raises(ValueError, match=f"{name}.*not available here.*flashinfer"):
            backends.get(name)
    assert backends.get("fp8_native", device="cpu").impl != "flashinfer"  # nothing else changes


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_FI and torch.cuda.is_available()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("name, kv_dtype", [("flashinfer_mla", "fp8_e4m3"), ("flashinfer_mla", "bf16"),
                                            ("flashinfer_mla_fp8", "fp8_e4m3")])
def test_flashinfer_matches_oracle(name, kv_dtype):
    pool = kvpool.random_pool(1, 64 * 400, 64, kv_dtype=kv_dtype, device="cuda", seed=1)
    batch = kvpool.batch_for_pool(pool, [1, 63, 64, 65, 3000, 8192], seed=2)
    qn, qp = kvpool.make_queries(6, 16, device="cuda")
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, 1 / 16)
    out = backends.get(name).decode(qn, qp, pool, 0, batch, 1 / 16)
    assert reference.rel_err(out, ref) < 1e-2
