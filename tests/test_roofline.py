"""labkit.roofline: byte and FLOP counts by hand, the ridge the study names, ceilings and their cache."""
import json

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit import roofline  # noqa: E402
from labkit.roofline import Ceilings, achieved, path_bytes, path_flops  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
P, L = 495_000, 8_192  # the seed's pool; a batch reading 8K tokens
Q_OUT = 1 * 64 * 576 * 2 + 1 * 64 * 512 * 2  # B=1, H=64: 73,728 + 65,536


@pytest.mark.parametrize("path, expected", [
    ("full_pool_cast", 855_360_000 + 9_437_184),  # 495,000 x 1,728 + 8,192 x 1,152
    ("gather_cast", 23_592_960),  # 8,192 x (576 + 1,152 + 1,152)
    ("fp8_native", 4_718_592),  # 8,192 x 576
    ("bf16_pool", 9_437_184),  # 8,192 x 1,152
])
def test_path_bytes_hand_counts(path, expected):
    assert path_bytes(path, P, L) == expected
    assert path_bytes(path, P, L, heads=64, batch=1) == expected + Q_OUT


def test_bf16_pool_has_nothing_to_cast():
    assert path_bytes("full_pool_cast", P, L, kv_dtype="bf16") == path_bytes("bf16_pool", P, L)
    assert path_bytes("fp8_native", P, L, kv_dtype="bf16") == 8_192 * 1_152
    assert path_bytes("gather_cast", P, L, kv_dtype="bf16") == 8_192 * (1_152 * 3)


def test_unknown_path_or_dtype_raises():
    with pytest.raises(ValueError, match="path="):
        path_bytes("fast", P, L)
    with pytest.raises(ValueError, match="kv_dtype="):
        path_bytes("fp8_native", P, L, kv_dtype="int4")


def test_flops_hand_count():
    assert path_flops(64, L) == 1_140_850_688  # 2 x 64 x 8,192 x 1,088
    assert path_flops(0, L) == 0


def test_fp8_native_intensity_and_h200_ridge():
    """The study: intensity ~3.8*h FLOP/B, compute-bound from about h = 49 on an H200."""
    assert path_flops(16, L) / path_bytes("fp8_native", P, L) == pytest.approx(3.78 * 16, rel=1e-3)
    h200 = Ceilings(copy_gbps=4270, matmul_tflops=790, device_name="H200", method="study")
    shape = dict(pool_tokens=P, tokens_read=64 * 8192)  # KV bytes only, as the study counts
    assert achieved("fp8_native", 1.0, h200, heads=48, **shape)["bound"] == "memory"
    assert achieved("fp8_native", 1.0, h200, heads=50, **shape)["bound"] == "compute"


def test_seed_cast_bandwidth_matches_the_h200_figure():
    """0.827 ms for the whole-pool cast of 495,000 x 576 FP8 is ~1.0 TB/s (STUDY.md)."""
    cast_only = path_bytes("full_pool_cast", P, 0)
    assert cast_only / 0.827e-3 / 1e12 == pytest.approx(1.03, abs=0.01)


def test_achieved_arithmetic():
    c = Ceilings(copy_gbps=4000, matmul_tflops=800, device_name="x", method="x")
    shape = dict(pool_tokens=P, tokens_read=L, heads=16, batch=4)
    nbytes, flops = path_bytes("fp8_native", **shape), path_flops(16, L)
    roof_ms = nbytes / 4000e9 * 1e3  # memory-bound at 16 heads
    r = achieved("fp8_native", 2 * roof_ms, c, **shape)
    assert r["bytes"] == nbytes and r["flops"] == flops and r["bound"] == "memory"
    assert r["gbps"] == pytest.approx(2000) and r["pct_bandwidth"] == pytest.approx(50)
    assert r["roofline_ms"] == pytest.approx(roof_ms) and r["pct_roofline"] == pytest.approx(50)
    assert r["tflops"] == pytest.approx(flops / (2 * roof_ms * 1e-3) / 1e12)
    assert r["pct_compute"] == pytest.approx(100 * r["tflops"] / 800)


def test_cpu_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch):
    c = roofline.measure_ceilings("cpu", tmp_path, copy_bytes=8 << 20, matmul_n=256)
    assert c.copy_gbps > 0.1 and c.matmul_tflops > 1e-4
    assert c.device_name == "CPU" and c.method.startswith("CPU")
    assert json.loads((tmp_path / "ceilings-cpu.json").read_text())["copy_gbps"] == c.copy_gbps

    def fail(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(roofline, "_measure", fail)
    assert roofline.measure_ceilings("cpu", tmp_path) == c


def test_plot_roofline_draws_every_point():
    c = Ceilings(4270, 790, "H200", "study")
    pts = pd.DataFrame(dict(label=["a", "b"], intensity=[60.0, 480.0], tflops=[200.0, 500.0]))
    ax = roofline.plot_roofline(pts, c)
    assert len(ax.collections) == 2 and [t.get_text() for t in ax.texts] == ["a", "b"]
    assert ax.get_xscale() == "log" and "FLOP/byte" in ax.get_xlabel()


@pytest.mark.gpu
@needs_cuda
def test_cuda_ceilings(tmp_path):
    c = roofline.measure_ceilings("cuda", tmp_path)
    assert 500 < c.copy_gbps < 10_000 and 50 < c.matmul_tflops < 3_000
    assert "GiB copy" in c.method and (tmp_path / "ceilings-cuda.json").exists()
