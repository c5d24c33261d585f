"""labkit.profiling: the naming rules, and the torch paths' profiles on the CPU."""
import inspect
import json

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent

from labkit import backends, kvpool
from labkit.profiling import CATEGORIES, categorize, profile_decode_step
from labkit.timing import bench

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FP8, BF16 = "c10::Float8_e4m3fn", "c10::BFloat16"
DTYPES_KNOWN = "input_dtypes" in inspect.signature(FunctionEvent.__init__).parameters


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name, dtype, scopes, notes, expected", [
    ("aten::to", FP8, ("full_pool_cast", "decode"), (), "cast"),
    ("aten::to", BF16, ("attend_16bit", "full_pool_cast"), (), "attention"),  # fp32 math of the torch attention
    ("aten::to", "int", ("gather_cast",), (), "other"),  # index dtype, not KV
    ("aten::index", FP8, ("gather_cast",), (), "gather"),
    ("aten::index", BF16, ("attend_16bit",), (), "attention"),
    ("aten::mm", "float", (), (), "attention"),
    ("aten::mm", "float", (), ("cast",), "cast"),  # a record_function range wins
    ("aten::add", "float", (), (), "other"),
    ("_fp8_to_bf16_kernel", None, (), (), "cast"),
    ("_gather_cast_kernel", None, (), (), "cast"),
    ("_mla_decode_fp8_kernel", None, (), (), "attention"),
    ("_mla_merge_kernel", None, ("fp8_native",), (), "merge"),
    ("aten::amax", BF16, ("mla_decode_fp8", "fp8_native_triton"), (), "attention"),  # q quantized for FP8 dots
    ("aten::empty", None, ("mla_merge",), (), "merge"),
    ("flash::FlashAttnFwdSm90", None, (), (), "attention"),
    ("some_kernel", None, ("attend_16bit",), (), "attention"),
    ("some_kernel", None, (), (), "other"),
])
def test_categorize(name, dtype, scopes, notes, expected):
    assert categorize(name, dtype, scopes, notes) == expected


def _setup(pool_tokens, layers=2, lens=(256, 128), heads=4, device="cpu"):
    pool = kvpool.random_pool(layers, pool_tokens, 32, device=device)
    batch = kvpool.batch_for_pool(pool, list(lens))
    qn, qp = kvpool.make_queries(len(lens), heads, device=device)
    return qn, qp, pool, batch


def _profile(name, pool_tokens, **kw):
    qn, qp, pool, batch = _setup(pool_tokens, **kw)
    df = profile_decode_step(backends.get(name), qn, qp, pool, batch, 0.0625)
    return df.set_index("category")


def test_table_shape_and_shares(tmp_path):
    qn, qp, pool, batch = _setup(4096)
    df = profile_decode_step(backends.get("gather_cast.torch"), qn, qp, pool, batch, 0.0625,
                             trace_path=tmp_path / "trace.json")
    assert list(df.columns) == ["category", "device_ms", "share", "calls"]
    assert list(df.category) == list(CATEGORIES) + ["total"]
    body = df[df.category != "total"]
    assert body.share.sum() == pytest.approx(1.0)
    assert df.iloc[-1].device_ms == pytest.approx(body.device_ms.sum())
    assert df.attrs["activity"] == "cpu" and df.attrs["layers"] == 2
    t = df.set_index("category")
    # per layer: one index of the FP8 pages, one cast of them (and, where the profiler gives no
    # dtypes, as torch 2.11's does, the int32 -> int64 index conversion too)
    assert t.loc["gather", "calls"] == 2
    assert t.loc["cast", "calls"] == 2 if DTYPES_KNOWN else t.loc["cast", "calls"] >= 2
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::index" for e in events)


def test_full_pool_cast_share_grows_with_the_pool():
    small = _profile("full_pool_cast.torch", 2048, layers=1)
    large = _profile("full_pool_cast.torch", 32768, layers=1)
    assert small.loc["cast", "share"] > 0 and small.loc["cast", "calls"] == 1
    assert large.loc["cast", "share"] > small.loc["cast", "share"]
    assert large.loc["cast", "share"] > 0.5  # 32K rows cast against 384 rows attended
    assert large.loc["gather", "calls"] == 0


def test_fp8_native_has_no_cast_pass():
    df = _profile("fp8_native.torch", 4096)
    assert df.loc["cast", "calls"] == 0 and df.loc["gather", "calls"] == 0
    assert df.loc["attention", "share"] == pytest.approx(1.0)


def test_layers_argument():
    qn, qp, pool, batch = _setup(2048, layers=3)
    b = backends.get("full_pool_cast.torch")
    assert profile_decode_step(b, qn, qp, pool, batch, 0.0625, layers=2).attrs["layers"] == 2
    df = profile_decode_step(b, qn, qp, pool, batch, 0.0625, layers=[0, 2], warmup=0)
    assert df.attrs["layers"] == 2 and df.set_index("category").loc["cast", "calls"] == 2


@pytest.mark.gpu
@needs_cuda
def test_cuda_full_pool_cast():
    qn, qp, pool, batch = _setup(262144, layers=2, lens=(1024, 512), device="cuda")
    b = backends.get("full_pool_cast.torch")
    df = profile_decode_step(b, qn, qp, pool, batch, 0.0625).set_index("category")
    assert df.attrs["activity"] == "cuda"
    assert df.loc["cast", "calls"] == 2 and df.loc["cast", "share"] > 0.1  # one whole-layer cast a layer
    assert df.loc["attention", "device_ms"] > 0
    # kernels on one stream cannot add up to more than the step takes (ranges are not work)
    step = bench(lambda: [b.decode(qn, qp, pool, i, batch, 0.0625) for i in range(2)], flush_l2=False)
    assert df.loc["total", "device_ms"] <= 1.1 * step.median_ms


def test_context_from_plain_events():
    """Only name, cpu_parent and device_type are read: what torch 2.11 and 2.13 events both have."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from labkit import profiling

    def ev(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=DeviceType.CPU)

    step = ev(profiling.STEP_RANGE)
    outer = ev(profiling.SCOPE_PREFIX + "full_pool_cast", step)
    to = ev("aten::to", ev(profiling.SCOPE_PREFIX + "attend_16bit", outer))
    copy = ev("aten::copy_", ev("aten::_to_copy", to))
    top, scopes, notes, inside = profiling._context(copy)
    assert top is to and inside and scopes == ["attend_16bit", "full_pool_cast"] and notes == [profiling.STEP_RANGE]
    assert not profiling._context(ev("aten::to"))[3]  # outside the step: not counted


def test_scope_ranges_wrap_calls():
    from torch.profiler import ProfilerActivity, profile

    from labkit import profiling, torch_paths

    qn, qp, pool, batch = _setup(1024, layers=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof, profiling._ScopeRanges():
        torch_paths.full_pool_cast(qn, qp, pool, 0, batch, 0.0625)
    names = [e.name for e in prof.events()]
    assert names.count(profiling.SCOPE_PREFIX + "attend_16bit") == 1
    import sys
    assert sys.getprofile() is None


@pytest.mark.gpu
@needs_cuda
def test_cuda_triton_launch_is_named_by_its_kernel():
    import triton
    import triton.language as tl

    from labkit import torch_paths

    @triton.jit
    def _toy_cast_kernel(x, y, n, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(y + o, tl.load(x + o, mask=o < n).to(tl.bfloat16), mask=o < n)

    class ToyCast:
        name = "toy"

        def decode(self, qn, qp, pool, layer, batch, sm_scale):
            x = pool.layer(layer)
            y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
            _toy_cast_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), B=4096)
            return torch_paths.attend_16bit(qn, qp, y, batch, sm_scale, 1.0)

    qn, qp, pool, batch = _setup(65536, layers=3, device="cuda")
    df = profile_decode_step(ToyCast(), qn, qp, pool, batch, 0.0625).set_index("category")
    assert df.loc["cast", "calls"] == 3 and df.loc["attention", "calls"] > 0
