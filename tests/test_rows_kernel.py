"""``mla_decode_fp8_rows`` (dense and sparse, both FP8 row layouts, both precisions) against a float64
reference computed here from the dequantized pool.

Every pool row that the batch must not read is poisoned first (NaN in every field), so a read of a
masked slot, of an unselected token or of a page tail past kv_lens shows up as a NaN output. CPU
shapes are tiny (the interpreter costs 1-3 ms a program); ``gpu`` tests run the compiled kernel on
small and batched shapes (skipped without CUDA).
"""
from __future__ import annotations

import pytest
import torch

from labkit import backends, kvpool, timing
from labkit.kernels.mla_decode_fp8_rows import mla_decode_fp8_rows

SM = 1 / 16
TOL = {"fast": 5e-2, "accurate": 3e-3}  # the bar for "accurate"; fast: e4m3 query and p
LAYOUTS = ("fp8_per_tensor", "fp8_ds_mla")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def context_rows(batch, b: int) -> torch.Tensor:
    """Rows of kv_rows that request b's page table covers: [kv_lens[b]] int64."""
    pages = batch.pages_of(b).long().cpu()
    rows = (pages[:, None] * batch.page_size + torch.arange(batch.page_size)).flatten()
    return rows[: int(batch.kv_lens[b])]


def random_slots(batch, topk: int, seed: int) -> torch.Tensor:
    """[B, topk] int32: each request's slots drawn from its own tokens, -1 padding at the end."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((batch.batch_size, topk), -1, dtype=torch.int32)
    for b in range(batch.batch_size):
        rows = context_rows(batch, b)
        pick = rows[torch.randperm(rows.numel(), generator=gen)[:topk]]
        out[b, : pick.numel()] = pick.to(torch.int32)
    return out


def reference(q_nope, q_pe, real_rows, reads, sm_scale):
    """float64 decode: real_rows [pool_tokens, 576] real values; reads[b] the rows request b attends."""
    q = torch.cat([q_nope, q_pe], -1).double().cpu()
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for b, rows in enumerate(reads):
        kv = real_rows[rows]  # [n, 576]
        p = torch.softmax((q[b] @ kv.T) * sm_scale, -1)
        out[b] = p @ kv[:, :512]
    return out


def poison_except(pool, layer: int, keep: torch.Tensor) -> None:
    """NaN in every byte field of every row of ``pool.rows(layer)`` not in ``keep``."""
    rows = pool.rows(layer).view(torch.uint8)
    mask = torch.ones(rows.shape[0], dtype=torch.bool)
    mask[keep.long().cpu()] = False
    rows[mask.to(rows.device)] = 0xFF  # e4m3 0xFF, fp32 and bf16 all-ones: NaN


def make_case(layout, page_size, lens, heads, topk=0, seed=0, device="cpu"):
    """(pool, batch, q_nope, q_pe, reads, ref_rows): the pool poisoned outside what is read."""
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 2)
    pool = kvpool.random_pool(1, ptok, page_size, kv_layout=layout, seed=seed, device=device)
    batch = kvpool.batch_for_pool(pool, lens, seed=seed + 1)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=seed + 2, device=device)
    real = pool.dequant(0, torch.float64).flatten(0, 1).cpu()  # before the poison
    if topk:
        slots = random_slots(batch, topk, seed + 3)
        reads = [s[s >= 0].long() for s in slots]
        batch = batch.with_slots(slots.to(device))
    else:
        reads = [context_rows(batch, b) for b in range(len(lens))]
    poison_except(pool, 0, torch.cat(reads))
    return pool, batch, qn, qp, reads, real


def run(pool, batch, qn, qp, precision, **kw):
    k_scale = 1.0 if pool.kv_layout == "fp8_ds_mla" else pool.scale(0)
    common = dict(sm_scale=SM, kv_layout=pool.kv_layout, k_scale=k_scale, precision=precision, **kw)
    if batch.token_indices is not None:
        return mla_decode_fp8_rows(qn, qp, pool.rows(0), token_indices=batch.token_indices, **common)
    return mla_decode_fp8_rows(qn, qp, pool.rows(0), kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
                               kv_lens=batch.kv_lens, page_size=batch.page_size, max_len=batch.max_len, **common)


def rel_err(out, ref) -> float:
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "NaN output: a poisoned row was read or an output left unwritten"
    return float((out - ref).norm() / ref.norm())


# (layout, page_size, lens, heads, topk, num_splits): contexts not a multiple of the 64-token tile,
# heads not a multiple of the head block (20 of 32; 40 = 64 + a partial block... of 64)
CPU_CASES = [
    ("fp8_per_tensor", 16, [37, 100], 20, 0, 1),
    ("fp8_ds_mla", 4, [100, 9], 20, 0, 2),
    ("fp8_per_tensor", 1, [50, 160], 20, 96, 1),  # request 0: 50 slots, 46 x -1
    ("fp8_ds_mla", 8, [200, 70], 40, 96, 2),  # 40 heads: one block of 64, 24 masked
]
# ds_mla cases run with both ways of applying the group scales; per-tensor rows have one way
CPU_PARAMS = [c + (mode,) for c in CPU_CASES for mode in (("widen", "groups") if c[0] == "fp8_ds_mla" else ("-",))]


@pytest.mark.parametrize("precision", ["fast", "accurate"])
@pytest.mark.parametrize("layout,page_size,lens,heads,topk,splits,ds_scales", CPU_PARAMS)
def test_rows_kernel_cpu(layout, page_size, lens, heads, topk, splits, ds_scales, precision):
    pool, batch, qn, qp, reads, real = make_case(layout, page_size, lens, heads, topk)
    kw = {} if ds_scales == "-" else dict(ds_scales=ds_scales)
    out = run(pool, batch, qn, qp, precision, num_splits=splits, **kw)
    assert out.shape == qn.shape and out.dtype == qn.dtype
    err = rel_err(out, reference(qn, qp, real, reads, SM))
    assert err < TOL[precision], err
    if precision == "fast" and ds_scales != "widen":  # the e4m3 query and p cost accuracy
        assert err > 2e-3, err
    if precision == "fast" and ds_scales == "widen":  # bf16 query and p: far under the e4m3 paths
        assert err < 4e-3, err


@pytest.mark.parametrize("topk", [0, 96])
def test_rows_kernel_cpu_widen_p_split(topk):
    """ds_scales="widen": "accurate" (p as bf16 hi + lo) is closer to float64 than "fast" (one bf16
    p), and both agree with the FP8 "groups" way within the e4m3 query's error."""
    pool, batch, qn, qp, reads, real = make_case("fp8_ds_mla", 8, [130, 61], 24, topk, seed=13)
    ref = reference(qn, qp, real, reads, SM)
    fast = run(pool, batch, qn, qp, "fast", num_splits=2)
    acc = run(pool, batch, qn, qp, "accurate", num_splits=2)
    groups = run(pool, batch, qn, qp, "accurate", ds_scales="groups", num_splits=2)
    assert rel_err(acc, ref) < rel_err(fast, ref) < 4e-3
    assert rel_err(acc, groups.double()) < TOL["accurate"] * 2


def test_rows_kernel_cpu_widen_fp16_query():
    """ds_scales="widen" with fp16 queries (rounded to bf16 in the kernel) and an fp16 output."""
    pool, batch, qn, qp, reads, real = make_case("fp8_ds_mla", 8, [150], 16, topk=96, seed=17)
    qn, qp = qn.half(), qp.half()
    ref = reference(qn, qp, real, reads, SM)
    fast, acc = (run(pool, batch, qn, qp, prec) for prec in ("fast", "accurate"))
    assert fast.dtype == torch.float16
    err_fast, err_acc = rel_err(fast, ref), rel_err(acc, ref)
    assert err_acc < 1e-3 and err_acc < err_fast < 4e-3, (err_fast, err_acc)


@pytest.mark.parametrize("precision", ["fast", "accurate"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_kernel_cpu_fp8_pv(layout, precision):
    """P.V as an FP8 dot: p * 256 in e4m3 (accurate: split into two e4m3 terms), V as stored (ds_mla:
    the "groups" way; "widen" takes no pv)."""
    pool, batch, qn, qp, reads, real = make_case(layout, 4, [90], 16, topk=64, seed=5)
    kw = dict(ds_scales="groups") if layout == "fp8_ds_mla" else {}
    out = run(pool, batch, qn, qp, precision, pv="fp8", **kw)
    assert rel_err(out, reference(qn, qp, real, reads, SM)) < TOL[precision]


@pytest.mark.parametrize("precision", ["fast", "accurate"])
def test_rows_kernel_cpu_query_quantized_in_kernel(precision):
    """q_pre=False: each program quantizes its query tile itself (no separate launch)."""
    pool, batch, qn, qp, reads, real = make_case("fp8_ds_mla", 16, [70], 20, seed=7)
    out = run(pool, batch, qn, qp, precision, q_pre=False, num_splits=2, ds_scales="groups")
    assert rel_err(out, reference(qn, qp, real, reads, SM)) < TOL[precision]


def test_graph_times_rotates_layers_cpu(monkeypatch):
    """On the CPU graph_times times the rotation with the clock: per call = per rotation / layers."""
    ticks = iter(range(0, 10_000, 3))  # every clock read advances 3 s
    monkeypatch.setattr(timing, "_clock", lambda: next(ticks))
    seen = []
    t = timing.graph_times(seen.append, range(4), replays=5, warmup=1)
    assert seen == [0, 1, 2, 3] * 6 and t.n == 5 and t.method == "perf_counter"
    assert t.median_ms == pytest.approx(3e3 / 4)
    with pytest.raises(ValueError, match="layers"):
        timing.graph_times(seen.append, [])


def test_rows_kernel_rejects_bad_arguments():
    pool, batch, qn, qp, _, _ = make_case("fp8_per_tensor", 16, [20], 16)
    with pytest.raises(ValueError, match="kv_layout"):
        mla_decode_fp8_rows(qn, qp, pool.rows(0), sm_scale=SM, kv_layout="bf16", token_indices=batch.kv_lens[None])
    with pytest.raises(ValueError, match="precision"):
        run(pool, batch, qn, qp, "exact")
    with pytest.raises(ValueError, match="kv_rows"):
        mla_decode_fp8_rows(qn, qp, pool.rows(0), sm_scale=SM, kv_layout="fp8_ds_mla", page_size=16,
                            kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices, kv_lens=batch.kv_lens)
    with pytest.raises(ValueError, match="page_size"):
        mla_decode_fp8_rows(qn, qp, pool.rows(0), sm_scale=SM, kv_layout="fp8_per_tensor",
                            kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices, kv_lens=batch.kv_lens)
    with pytest.raises(ValueError, match="ds_scales"):
        run(pool, batch, qn, qp, "fast", ds_scales="scores")
    pool, batch, qn, qp, _, _ = make_case("fp8_ds_mla", 16, [20], 16)
    with pytest.raises(ValueError, match="pv"):
        run(pool, batch, qn, qp, "fast", pv="fp8")


@pytest.mark.parametrize("name,precision", [("fp8_native.triton_rows", "fast"),
                                            ("fp8_native.triton_rows_acc", "accurate")])
def test_rows_backends(name, precision):
    """Through the registry: per-layer slots of a sparse batch and a dense ds_mla batch. On fp8_ds_mla
    both are accurate (bf16 query and dots), and held to that precision's bar."""
    be = backends.get(name)
    assert be.precision == precision and be.sparse and be.dense
    assert be.precision_on("fp8_ds_mla") == "accurate" and be.precision_on("fp8_per_tensor") == precision
    pool, batch, qn, qp, reads, real = make_case("fp8_ds_mla", 8, [70, 33], 16, topk=64, seed=9)
    out = be.decode(qn, qp, pool, 0, batch, SM)
    assert rel_err(out, reference(qn, qp, real, reads, SM)) < TOL["accurate"]
    pool, batch, qn, qp, reads, real = make_case("fp8_per_tensor", 32, [70], 16, seed=11)
    out = be.decode(qn, qp, pool, 0, batch, SM)
    assert rel_err(out, reference(qn, qp, real, reads, SM)) < TOL[precision]


GPU_CASES = [  # small, then batched shapes; dense pages of 64 and sparse rows (page 1), as scripts/gpu_rows.py
    ("fp8_per_tensor", 64, [1, 63, 64, 65, 1000], 16, 0),
    ("fp8_ds_mla", 64, [1, 63, 64, 65, 1000], 64, 0),
    ("fp8_per_tensor", 1, [300, 5000], 128, 2048),
    ("fp8_ds_mla", 1, [300, 5000], 16, 2048),
    ("fp8_per_tensor", 64, [4096] * 16, 128, 0),
    ("fp8_ds_mla", 1, [8192] * 16, 64, 2048),
    ("fp8_per_tensor", 1, [2000] * 8, 100, 512),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fast", "accurate"])
@pytest.mark.parametrize("layout,page_size,lens,heads,topk", GPU_CASES)
def test_rows_kernel_gpu(layout, page_size, lens, heads, topk, precision):
    pool, batch, qn, qp, reads, real = make_case(layout, page_size, lens, heads, topk, device="cuda")
    out = run(pool, batch, qn, qp, precision)
    assert rel_err(out, reference(qn, qp, real, reads, SM)) < TOL[precision]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("topk", [0, 1024])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_kernel_gpu_variants(layout, topk):
    """P.V as an FP8 dot (p in e4m3; accurate: hi + lo terms) and 32-token tiles, with forced splits;
    ds_mla also the "groups" way at its own defaults."""
    pool, batch, qn, qp, reads, real = make_case(layout, 1 if topk else 64, [3000, 17], 64, topk=topk,
                                                 device="cuda")
    ref = reference(qn, qp, real, reads, SM)
    ds = dict(ds_scales="groups") if layout == "fp8_ds_mla" else {}
    variants = [dict(pv="fp8", **ds), dict(block_n=32, num_splits=7)] + ([ds] if ds else [])
    for precision in ("fast", "accurate"):
        for kw in variants:
            assert rel_err(run(pool, batch, qn, qp, precision, **kw), ref) < TOL[precision], (precision, kw)
