"""Per-batch plans of the Triton paths: the same kernels with the same arguments as the checked
launchers (equal outputs, bit for bit, in the interpreter), planned once, scratch reused."""
import pytest
import torch

from labkit import backends, kvpool, triton_plans
from labkit.kernels.launch import Launcher, SplitKV, _spec1
import triton.language as tl  # noqa: E402  (after labkit: it sets TRITON_INTERPRET on a CPU)
from triton.runtime.jit import JITFunction  # noqa: E402
from labkit.kernels.mla_decode import LOG2E, _mla_decode_kernel, mla_decode
from labkit.triton_paths import (fp8_native_triton, fp8_native_triton_q8, full_pool_cast_seed,
                                 full_pool_cast_triton, gather_cast_triton, bf16_pool_triton)

SM_SCALE = 1 / 16
CASES = [  # (checked function, planner, pool dtype)
    (full_pool_cast_triton, triton_plans.full_pool_cast(triton_plans.widen_triton), "fp8_e4m3"),
    (full_pool_cast_seed, triton_plans.full_pool_cast(triton_plans.widen_torch), "fp8_e4m3"),
    (gather_cast_triton, triton_plans.gather_cast_plan, "fp8_e4m3"),
    (fp8_native_triton, triton_plans.fp8_native(False), "fp8_e4m3"),
    (fp8_native_triton_q8, triton_plans.fp8_native(True), "fp8_e4m3"),
    (bf16_pool_triton, triton_plans.bf16_pool, "bf16"),
]


def _case(kv_dtype, heads=4, lens=(33, 70), pool_tokens=256):
    pool = kvpool.random_pool(2, pool_tokens, 16, kv_dtype=kv_dtype, seed=3)  # two layers, two k_scales
    batch = kvpool.batch_for_pool(pool, list(lens), seed=4)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=5)
    return pool, batch, qn, qp


@pytest.mark.parametrize("fn, planner, kv_dtype", CASES, ids=[c[0].__name__ for c in CASES])
def test_planned_run_equals_the_checked_launcher(fn, planner, kv_dtype):
    pool, batch, qn, qp = _case(kv_dtype)
    run = planner(pool, batch, qn.shape[1], SM_SCALE, qn.dtype)
    for layer in (1, 0):
        assert torch.equal(run(qn, qp, layer, batch), fn(qn, qp, pool, layer, batch, SM_SCALE))


def test_split_scratch_and_merge_equal_mla_decode_with_splits():
    pool, batch, qn, qp = _case("bf16", heads=16, lens=(200, 90), pool_tokens=512)
    kv = pool.layer(0)
    sk = SplitKV.make(2, 16, 3, qn.dtype, "cpu")
    assert sk.part_o.shape == (2, 16, 3, 512) and not sk.direct

    def stage1(o, lse, direct):
        _mla_decode_kernel[(2, 1, 3)](qn, qp, kv, batch.kv_indptr, batch.kv_indices, batch.kv_lens, o, lse,
                                      SM_SCALE * LOG2E, 1.0, 16, 3, qn.stride(0), qn.stride(1), qp.stride(0),
                                      qp.stride(1), kv.stride(0), o.stride(0), o.stride(1), PAGE=16, BLOCK_N=128,
                                      BLOCK_H=16, DIRECT=direct, F32_MATH=True)

    want = mla_decode(qn, qp, kv, batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM_SCALE, num_splits=3)
    first = sk.run(stage1, 1.0)
    part = sk.part_o
    second = sk.run(stage1, 1.0)  # the same scratch, a new output
    assert sk.part_o is part and first is not second
    assert torch.equal(first, want) and torch.equal(second, want)
    with pytest.raises(ValueError, match="num_splits=0"):
        SplitKV.make(2, 16, 0, qn.dtype, "cpu")
    assert SplitKV.make(2, 16, 3, qn.dtype, "cpu", torch.bfloat16).part_o.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="part_dtype=torch.float16; allowed"):
        SplitKV.make(2, 16, 3, qn.dtype, "cpu", torch.float16)


def test_plan_is_made_once_per_batch(monkeypatch):
    pool, batch, qn, qp = _case("fp8_e4m3")
    b = backends.get("fp8_native.triton")
    assert b.planner is not None
    calls = []
    real = b.planner
    monkeypatch.setattr(backends, "_PLANS", {})
    object.__setattr__(b, "planner", lambda *a: calls.append(a) or real(*a))
    try:
        plan = b.plan(pool, batch, qn.shape[1], SM_SCALE, qn.dtype)
        outs = [plan.run(qn, qp, layer) for layer in (0, 1, 0)]
        assert b.plan(pool, batch, qn.shape[1], SM_SCALE, qn.dtype) is plan
        b.decode(qn, qp, pool, 1, batch, SM_SCALE)
    finally:
        object.__setattr__(b, "planner", real)
    assert len(calls) == 1
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])


def test_unplanned_cases_fall_back_to_the_function():
    pool, batch, qn, qp = _case("fp8_e4m3")
    sparse = batch.with_slots(kvpool.random_slots(batch, 8, seed=1))
    assert triton_plans.fp8_native(True)(pool, sparse, 4, SM_SCALE, qn.dtype) is None
    ds = kvpool.random_pool(1, 256, 16, kv_layout="fp8_ds_mla")
    with pytest.raises(ValueError, match="sparse batches only"):  # the Gluon kernel reads ds_mla slots only
        triton_plans.gluon("fast")(ds, kvpool.batch_for_pool(ds, [20]), 4, SM_SCALE, qn.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_planned_runs_equal_the_checked_launchers(heads):
    """On the GPU (split counts > 1, FP8 queries quantized in the kernel, the Gluon kernel on Hopper)."""
    cases = CASES + [(backends.get(f"fp8_native.{n}").fn, triton_plans.gluon(p), "fp8_e4m3")
                     for n, p in (("gluon", "fast"), ("gluon_acc", "accurate"))]
    for fn, planner, kv_dtype in cases:
        pool = kvpool.random_pool(2, 64 * 400, 64, kv_dtype=kv_dtype, device="cuda", seed=3)
        batch = kvpool.batch_for_pool(pool, [1, 4097, 8192], seed=4)
        qn, qp = kvpool.make_queries(3, heads, device="cuda", seed=5)
        name = next(n for n in backends.names() if backends.get(n).fn is fn)
        try:
            backends.get(name).check(qn, pool, batch)
        except ValueError:
            continue  # e.g. the Gluon kernel off Hopper or past 32 heads
        run = planner(pool, batch, heads, SM_SCALE, qn.dtype)
        direct = Launcher.direct_total
        for layer in (1, 0, 1):  # the later calls launch the compiled kernels directly
            assert torch.equal(run(qn, qp, layer, batch), fn(qn, qp, pool, layer, batch, SM_SCALE)), (name, layer)
        assert Launcher.direct_total > direct, name
        # a query 2 bytes off 16-byte alignment specializes differently: Triton's JIT again, same result
        qn2 = torch.empty(qn.numel() + 1, dtype=qn.dtype, device="cuda")[1:].view_as(qn).copy_(qn)
        assert torch.equal(run(qn2, qp, 0, batch), fn(qn, qp, pool, 0, batch, SM_SCALE)), name


def _toy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


def test_launcher_passes_constexprs_after_the_runtime_arguments():
    """What a direct launch hands the compiled kernel: the runtime arguments, then every constexpr
    (given or defaulted) in the kernel's order; and what it keys a direct launch on."""
    k = Launcher(JITFunction(_toy), (4,), BLOCK=64, num_warps=4)
    assert k.direct_ok and k.n_runtime == 4 and k.consts == (64, True) and k.grid == (4, 1, 1)
    x = torch.zeros(64)

    def _spec(args):
        return tuple(map(_spec1, args))

    assert _spec((x, x, 1, 0.5)) != _spec((x, x, 2, 0.5)) != _spec((x, x, 32, 0.5))
    assert _spec((x, x, 17, 0.5)) == _spec((x, x, 3, 0.5))
    assert _spec((x[1:], x, 3, 0.5)) != _spec((x, x, 3, 0.5)) == _spec((x[4:], x, 3, 0.5))  # 4 floats: 16 B
    assert _spec((x.half(), x, 3, 0.5)) != _spec((x, x, 3, 0.5))
    assert _spec((x, x, 2**31, 0.5)) != _spec((x, x, 2**31 - 16, 0.5))
    # a direct launch after the first call: objects of the first call are not looked at again, others are
    k.compiled, k.first, k.spec = object(), (x, x, 3, 0.5), _spec((x, x, 3, 0.5))
    y = torch.zeros(64)
    assert k._specializes_alike((x, y, 19, 0.25)) and k._specializes_alike((x[4:], x, 3, 1.0))
    assert not k._specializes_alike((x, y[1:], 3, 0.5)) and not k._specializes_alike((x, x.half(), 3, 0.5))
    assert not k._specializes_alike((x, x, 1, 0.5)) and not k._specializes_alike((x, x, 3))


def test_launcher_steps_aside_for_launch_hooks(monkeypatch):
    """A profiler's launch hook must see every launch: with one set, no direct launches."""
    from labkit.kernels import launch
    assert launch._no_hooks()
    monkeypatch.setattr(launch.knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not launch._no_hooks()
