"""labkit.roofline: byte and FLOP counts by hand, the ridge the study names, ceilings (BF16 and FP8
matmul) and their cache, the plot's roofs and its label placement."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.legend  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
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
    assert c.fp8_tflops is None and c.tflops("fp8") is None and "no FP8 matmul ceiling on the CPU" in c.method
    assert json.loads((tmp_path / "ceilings-cpu.json").read_text())["copy_gbps"] == c.copy_gbps

    def fail(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(roofline, "_measure", fail)
    assert roofline.measure_ceilings("cpu", tmp_path) == c


def test_old_ceilings_file_without_fp8_loads(tmp_path):
    old = dict(copy_gbps=4274.0, matmul_tflops=795.0, device_name="NVIDIA H200", method="median cuda events")
    (tmp_path / "ceilings-cuda.json").write_text(json.dumps(old))
    c = roofline.measure_ceilings("cuda", tmp_path)  # read from the cache: no CUDA device needed
    assert (c.copy_gbps, c.matmul_tflops, c.fp8_tflops) == (4274.0, 795.0, None)
    assert c.tflops("bf16") == 795.0 and c.tflops("fp8") is None


@pytest.mark.parametrize("fp8, expected", [(1500.0, 1500.0), (None, None), (float("nan"), None), (0.0, None)])
def test_fp8_roof_absent_or_nan(fp8, expected):
    """Records carry a missing ceiling as NaN, a ceilings file as null: both mean not measured."""
    c = Ceilings(4000, 800, "x", "x", fp8)
    assert c.tflops("fp8") == expected and c.tflops("bf16") == 800
    with pytest.raises(ValueError, match="mma='fp4'"):
        c.tflops("fp4")


def test_achieved_takes_the_roof_of_its_mma():
    """128 heads: compute-bound; an FP8-MMA kernel is held to the FP8 rate, where it was measured."""
    shape = dict(pool_tokens=P, tokens_read=64 * 8192, heads=128)
    flops = path_flops(128, 64 * 8192)
    c = Ceilings(4000, 800, "x", "x", 1600)
    t = 2 * flops / (1600 * 1e9)  # ms: twice the FP8 compute time
    assert achieved("fp8_native", t, c, mma="fp8", **shape)["pct_roofline"] == pytest.approx(50)
    assert achieved("fp8_native", t, c, **shape)["pct_roofline"] == pytest.approx(100)  # BF16 roof: 2x longer
    no_fp8 = Ceilings(4000, 800, "x", "x")
    assert achieved("fp8_native", t, no_fp8, mma="fp8", **shape)["pct_roofline"] == pytest.approx(100)


def test_mma_of_the_fp8_kernels():
    for name in ("fp8_native.triton_q8", "fp8_native.gluon", "fp8_native.triton_rows", "fp8_native.triton_rows_acc"):
        assert roofline.mma_of(name) == "fp8"
    for name in ("fp8_native.triton", "fp8_native.torch", "bf16_pool.triton",
                 "full_pool_cast.seed", "flashinfer_mla_fp8", "fp8_native.flashinfer_mla_fp8"):
        assert roofline.mma_of(name) == "bf16"


def test_fp8_matmul_against_float32():
    """The operands' layout for torch._scaled_mm: a row-major, b column-major, unit scales."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 48, generator=g)
    a8, b8 = roofline.fp8_operands(a, b)
    assert a8.dtype == b8.dtype == torch.float8_e4m3fn and b8.stride() == (1, 96)
    want = a8.double() @ b8.double()
    try:
        got = roofline.fp8_matmul(a8, b8)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    assert got.dtype == torch.bfloat16 and got.shape == (64, 48)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-2)


def _boxes(ax):
    ax.figure.canvas.draw()
    r = ax.figure.canvas.get_renderer()
    return [t.get_window_extent(r) for t in ax.texts]


def test_place_labels_keeps_labels_apart_and_off_the_points():
    g = np.random.default_rng(0)
    pts = g.uniform(0, 60, size=(25, 2))  # 25 points crowded into 60 x 60 pixels
    box, marker = (12.0, 10.0), 3.0
    off = roofline.place_labels(pts, box, marker_px=marker)
    centres = pts + off
    half = np.array(box) / 2
    for i in range(len(pts)):
        for j in range(len(pts)):
            if i != j:
                assert (np.abs(centres[i] - centres[j]) >= 2 * half - 1e-9).any(), (i, j)  # labels apart
            assert (np.abs(centres[i] - pts[j]) >= half + marker - 1e-9).any(), (i, j)  # no label on a point
    assert np.abs(off).max() < 8 * max(box)  # and still beside its own point


def test_plot_roofline_numbers_each_point_against_its_roof():
    c = Ceilings(4270, 790, "H200", "study", 1580)
    heads = [8, 16, 32, 64, 128]
    pts = pd.DataFrame(dict(backend=["fp8_native.gluon"] * 5 + ["bf16_pool.triton"] * 5,
                            heads=heads * 2, intensity=[3.78 * h for h in heads] * 2,
                            tflops=[3.2 * h for h in heads] + [3.0 * h for h in heads]))
    pts["label"] = pts.backend + " h" + pts.heads.astype(str)
    ax = roofline.plot_roofline(pts, c)
    assert [t.get_text() for t in ax.texts] == [str(i) for i in range(1, 11)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "1  fp8_native.gluon h8 (fp8)" and legend[9] == "10  bf16_pool.triton h128 (bf16)"
    roofs = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 200]
    assert sorted(float(np.max(ln.get_ydata())) for ln in roofs) == [790, 1580]
    boxes = _boxes(ax)
    for i, a in enumerate(boxes):  # numbers never overlap each other
        assert not any(a.overlaps(b) for b in boxes[i + 1:]), ax.texts[i].get_text()
    px = ax.transData.transform(pts[["intensity", "tflops"]].to_numpy(float))
    for a in boxes:  # nor cover a point
        assert not any(a.contains(x, y) for x, y in px)
    assert ax.get_xscale() == "log" and "FLOP/byte" in ax.get_xlabel()
    plt.close("all")


def test_plot_roofline_without_an_fp8_ceiling_says_so():
    c = Ceilings(4270, 790, "H200", "recorded", float("nan"))
    pts = pd.DataFrame(dict(label=["a", "b"], intensity=[60.0, 480.0], tflops=[200.0, 500.0], mma=["fp8", "bf16"]))
    ax = roofline.plot_roofline(pts, c)
    roof_legend = next(a for a in ax.get_children() if isinstance(a, matplotlib.legend.Legend)
                       and a is not ax.get_legend())  # the points' legend is ax.get_legend()
    texts = [t.get_text() for t in roof_legend.get_texts()]
    assert "FP8 roof: not measured here" in texts and any(t.startswith("BF16 roof: 4270 GB/s") for t in texts)
    assert [t.get_text() for t in ax.texts] == ["1", "2"]
    plt.close("all")


@pytest.mark.gpu
@needs_cuda
def test_cuda_ceilings(tmp_path):
    c = roofline.measure_ceilings("cuda", tmp_path)
    assert 500 < c.copy_gbps < 10_000 and 50 < c.matmul_tflops < 3_000
    if roofline.fp8_supported(torch.device("cuda")):  # FP8 tensor cores: at least the BF16 rate
        assert c.matmul_tflops < c.fp8_tflops < 6_000 and "_scaled_mm" in c.method
    else:
        assert c.fp8_tflops is None
    assert "GiB copy" in c.method and (tmp_path / "ceilings-cuda.json").exists()
