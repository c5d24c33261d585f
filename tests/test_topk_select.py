"""The Triton top-k (labkit.kernels.topk_select) against torch.topk and float64 sorting.

A long context's slots must be topk distinct tokens of its own context whose logits, sorted, equal
the topk largest logits sorted (exact float comparison): the same set up to ties at the k-th
logit. A short one (kv_lens[b] <= topk) gets every token in context order, then -1. NaN counts
as -inf. The CPU tests run Triton's interpreter at small sizes; the GPU test at GLM-5's.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import config, kvpool
from labkit.indexer import Indexer, check_slots, default_topk_impl, positions_of, select_tokens, token_ids
from labkit.kernels import topk_select as topk_module
from labkit.kernels.topk_select import default_count, topk_select

POISON = -123456  # what torch.empty gives int32 tensors in these tests: an unwritten slot shows


@pytest.fixture
def poisoned_ints(monkeypatch):
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        t.fill_(float("nan") if t.is_floating_point() else POISON)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _table(lens, page_size, seed=0):
    """A page table (kv_indptr, kv_indices int32, pages scattered) for contexts of ``lens`` tokens."""
    pages = [max(1, math.ceil(n / page_size)) for n in lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    return indptr, torch.randperm(sum(pages) + 5, generator=gen)[: sum(pages)].to(torch.int32)


def _assert_topk(slots, logits, lens, indptr, indices, page_size, topk):
    """slots [B, topk] against float64 sorting of logits [B, >= max(lens)], per request."""
    assert slots.dtype == torch.int32 and tuple(slots.shape) == (len(lens), topk)
    for b, n in enumerate(lens):
        start = int(indptr[b])
        ids = [int(indices[start + p // page_size]) * page_size + p % page_size for p in range(n)]
        row = slots[b].tolist()
        if n <= topk:
            assert row == ids + [-1] * (topk - n), f"request {b}: all {n} tokens in order, then -1"
            continue
        where = {t: p for p, t in enumerate(ids)}
        assert all(t in where for t in row), f"request {b}: a slot outside its context"
        pos = torch.tensor([where[t] for t in row])
        assert pos.unique().numel() == topk, f"request {b}: a token twice"
        x = logits[b, :n].double().nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        want = x.sort(descending=True).values[:topk]
        assert torch.equal(x[pos].sort(descending=True).values, want), f"request {b}: not the top-{topk}"


def _rows(T, gen):
    """[8, T] float32 logits, one kind of row each."""
    g = torch.randn(8, T, generator=gen)
    x = g.clone()
    x[1] = (g[1] * 2).round()  # many ties, also at the k-th value
    x[2] = -g[2].abs() * 1e-3 - 5.0  # all negative
    x[3, ::2] = -math.inf  # -inf inside the context
    x[4] = 0.25  # one value: all ties
    x[5] = (2 * g[5]).exp()  # heavy right tail
    x[6, ::37] = 1e30  # outliers: a few huge keys above a dense body
    x[7, ::5] = math.nan
    return x


@pytest.mark.parametrize("digit_bits,cand_block,count", [(8, 64, "histogram"), (4, 16, "histogram"),
                                                         (2, 1024, "histogram"), (8, 64, "atomic"), (4, 16, "atomic")])
def test_topk_matches_sorting(digit_bits, cand_block, count, poisoned_ints):
    """Every kind of row, each radix width; candidates in one tile (cand_block 1024) and in several
    (16); the row rounds counted by tl.histogram and by atomics into counters the kernel zeroes."""
    T, topk, page_size = 700, 48, 16
    lens = [700, 650, 49, 400, 300, 690, 500, 600]
    x = _rows(T, torch.Generator().manual_seed(digit_bits))
    indptr, indices = _table(lens, page_size, seed=digit_bits)
    slots = topk_select(x, torch.tensor(lens, dtype=torch.int32), indptr, indices, page_size, topk,
                        block=128, cand_block=cand_block, digit_bits=digit_bits, count=count)
    _assert_topk(slots, x, lens, indptr, indices, page_size, topk)


@pytest.mark.parametrize("regs", [1024, 512])
def test_rows_selected_in_registers(regs, poisoned_ints):
    """regs: rows of at most that many keys are selected in registers, longer ones by the passes
    (700 > 512), in one launch; every kind of row, and many keys tied at the k-th."""
    T, topk, page_size = 700, 48, 16
    lens = [700, 650, 49, 400, 300, 690, 500, 48]
    x = _rows(T, torch.Generator().manual_seed(regs))
    x[0, 200:260] = x[0].sort(descending=True).values[40]  # 60 ties around the k-th
    indptr, indices = _table(lens, page_size, seed=regs)
    slots = topk_select(x, torch.tensor(lens, dtype=torch.int32), indptr, indices, page_size, topk,
                        block=128, cand_block=64, regs=regs)
    _assert_topk(slots, x, lens, indptr, indices, page_size, topk)


def test_short_and_edge_lengths(poisoned_ints):
    """Lengths 0, 1, topk (short: in order, then -1), topk + 1, and topk = 1; page size 1."""
    T, topk = 40, 17
    lens = [0, 1, 17, 18, 40]
    x = torch.randn(len(lens), T, generator=torch.Generator().manual_seed(5))
    indptr, indices = _table(lens, 1, seed=5)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    for k in (topk, 1):
        slots = topk_select(x, kv_lens, indptr, indices, 1, k, splits=1, block=16, cand_block=16)
        _assert_topk(slots, x, lens, indptr, indices, 1, k)
    empty = torch.zeros(0, dtype=torch.int32)
    none = topk_select(x[:0], empty, torch.zeros(1, dtype=torch.int32), empty, 1, topk)
    assert none.shape == (0, topk) and none.dtype == torch.int32


def test_barrier_counts_are_made_once_and_grow():
    """The split kernel's per-request arrival counts: zeroed when made, kept (the kernel leaves them
    at zero), replaced by a larger zeroed buffer only when a batch needs more."""
    dev = torch.device("cpu")
    topk_module._BARRIERS.pop(dev, None)
    a = topk_module._barriers(dev, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and not a.any()
    assert topk_module._barriers(dev, a.numel()) is a
    b = topk_module._barriers(dev, a.numel() + 1)
    assert b is not a and b.numel() > a.numel() and not b.any()
    topk_module._BARRIERS.pop(dev, None)


def test_candidates_past_one_tile(poisoned_ints):
    """Many keys sharing the k-th key's top 16 bits (a narrow band of logits): the candidate passes
    run over several tiles, and ties at the k-th logit are cut at exactly topk."""
    n, topk = 900, 300
    x = 1.0 + torch.rand(1, n, generator=torch.Generator().manual_seed(11)) * 2.0 ** -10  # one 16-bit prefix
    x[0, 100:200] = x[0, 150]  # a block of equal values
    indptr, indices = _table([n], 4)
    slots = topk_select(x, torch.tensor([n], dtype=torch.int32), indptr, indices, 4, topk, block=64, cand_block=32)
    _assert_topk(slots, x, [n], indptr, indices, 4, topk)


@pytest.mark.parametrize("sample,block", [(16, 64), (64, 128), (256, 1024)])
def test_sampled_candidates_match_sorting(sample, block, poisoned_ints):
    """The prefilter (a sampled threshold, then the radix select among the candidates) on every kind
    of row: samples smaller than topk, about topk, and the whole row; tiles of the pass below and
    above the row's length."""
    T, topk, page_size = 700, 48, 16
    lens = [700, 650, 49, 400, 300, 690, 500, 600]
    x = _rows(T, torch.Generator().manual_seed(sample))
    indptr, indices = _table(lens, page_size, seed=sample)
    slots = topk_select(x, torch.tensor(lens, dtype=torch.int32), indptr, indices, page_size, topk,
                        block=block, cand_block=64, sample=sample)
    _assert_topk(slots, x, lens, indptr, indices, page_size, topk)
    short = [0, 1, 48, 49]
    y = torch.randn(len(short), 60, generator=torch.Generator().manual_seed(1))
    indptr, indices = _table(short, 1, seed=1)
    slots = topk_select(y, torch.tensor(short, dtype=torch.int32), indptr, indices, 1, topk, block=16, sample=sample)
    _assert_topk(slots, y, short, indptr, indices, 1, topk)


def test_prefilter_keeps_few_and_falls_back(poisoned_ints):
    """On a row without structure the candidates are a superset of the top-k and far fewer than the
    row; where the large logits sit only between the sampled positions the threshold comes out too
    high, and the second pass keeps every position (the selection is still exact)."""
    from labkit.kernels.topk_prefilter import topk_prefilter

    n, topk, sample = 4096, 64, 256
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, n, generator=gen)
    x[1] = torch.rand(n, generator=gen) * 0.5
    x[1, ::16] = 1.0  # exactly the sampled positions (j * n // sample, stride 16): 256 keys above the rest
    x[1, 1::16][:topk] = 0.75  # the top-k's remainder sits between them
    lens, (indptr, indices) = torch.tensor([n, n], dtype=torch.int32), _table([n, n], 1)
    topk2 = 300  # > 256 sampled ones: the sample's threshold (the prefix of 1.0) keeps too few
    crow, cslot, count, _ = topk_prefilter(x, lens, indptr, indices, 1, topk, sample)
    c = int(count[0])
    where = {int(t): p for p, t in enumerate(indices[:n])}
    pos = torch.tensor([where[int(t)] for t in cslot[0, :c]])
    left = torch.ones(n, dtype=torch.bool)
    left[pos] = False
    assert topk <= c < n // 8 and torch.equal(pos, pos.sort().values)  # distinct, in position order
    assert torch.equal(crow[0, :c], x[0, pos]) and x[0, pos].min() > x[0, left].max()
    _, _, count, _ = topk_prefilter(x, lens, indptr, indices, 1, topk2, sample)
    assert int(count[1]) == n
    for k in (topk, topk2):
        slots = topk_select(x, lens, indptr, indices, 1, k, block=512, sample=sample)
        _assert_topk(slots, x, [n, n], indptr, indices, 1, k)


@pytest.mark.parametrize("page_size", [1, 16])
def test_select_tokens_triton_equals_torch(page_size):
    """Through labkit.indexer: the indexer's own logits, both top-k implementations, the same sets."""
    cfg = config.load_model("tiny")
    lens, topk = [300, 20, 129], 64
    pool = kvpool.random_pool(1, page_size * (sum(-(-n // page_size) for n in lens) + 2), page_size, seed=3)
    batch = kvpool.batch_for_pool(pool, lens, seed=4)
    ix = Indexer(cfg, pool, batch, seed=5, index_topk=topk)
    logits = ix.logits(0, "torch")
    got = select_tokens(logits, batch, topk, topk_impl="triton")  # checked by check_slots too
    want = select_tokens(logits, batch, topk, topk_impl="torch")
    for b in range(len(lens)):
        assert set(got[b].tolist()) == set(want[b].tolist())  # random logits: no ties
    assert torch.equal(ix.topk(0, "torch", topk_impl="triton"), got)
    assert default_topk_impl("cpu") == "torch"
    assert default_topk_impl("cpu", 64, 32768) == "torch"


@pytest.mark.parametrize("batch_size,max_len,want", [(1, 32768, "triton"), (7, 8192, "triton"), (8, 32768, "cuda"),
                                                     (8, 32769, "triton"), (31, 131072, "triton"), (32, 131072, "cuda"),
                                                     (128, 8192, "cuda"), (None, None, "triton")])
def test_default_topk_on_cuda_by_shape(batch_size, max_len, want, monkeypatch):
    """On CUDA the CUDA C top-k from 32 requests, or from 8 of at most 32K, where it compiles;
    the Triton kernel otherwise (no device needed: whether it compiles is stubbed)."""
    from labkit.kernels import topk_cuda

    monkeypatch.setattr(topk_cuda, "available", lambda device: True)
    assert default_topk_impl("cuda", batch_size, max_len) == want
    monkeypatch.setattr(topk_cuda, "available", lambda device: False)
    assert default_topk_impl("cuda", batch_size, max_len) == "triton"


def test_keys_follow_float_order():
    """The radix select's int32 keys: as unsigned integers, the order of the floats; equal keys for
    equal floats (-0.0 and +0.0 too: ties are decided on keys)."""
    import triton  # here, not at the top: labkit must choose the interpreter before triton loads
    import triton.language as tl

    @triton.jit
    def _keys_kernel(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, topk_module._ukey(x_ptr + i, i < N))

    tiny = torch.finfo(torch.float32).tiny
    v = torch.tensor([-math.inf, -3e38, -1.5, -1.0, -tiny, -1e-45, -0.0, 0.0, 1e-45, tiny, 1.0, 1.5, 3e38, math.inf])
    x = torch.cat([v, v.flip(0), torch.randn(4)])  # 32 values
    keys = torch.empty(32, dtype=torch.int32)
    _keys_kernel[(1,)](x, keys, N=32)
    a, b = x[:, None], x[None, :]
    u = keys.long() & 0xFFFFFFFF  # the unsigned reading
    ka, kb = u[:, None], u[None, :]
    assert torch.equal(ka < kb, a < b) and torch.equal(ka == kb, a == b)


def test_positions_of_inverts_token_ids():
    batch = kvpool.make_batch(40, 16, [100, 37, 200], seed=2)
    pos = torch.tensor([[0, 99, 50, -1, 100], [36, 0, 5, 7, 37], [199, 3, 150, 16, 15]])
    ids = token_ids(batch, pos).to(torch.int32)
    assert torch.equal(positions_of(batch, ids), torch.where(pos < torch.tensor([[100], [37], [200]]), pos, -1))
    assert (positions_of(batch, ids[[1, 2, 0]]) == -1).all(), "tokens of other requests are not found"


def test_default_count_by_batch(poisoned_ints):
    """One request counts by atomics, more by tl.histogram (run 12a); one request's slots by the
    default equal those counted by histogram (the same set: the logits here have no ties)."""
    assert default_count(1) == "atomic" and default_count(2) == default_count(64) == "histogram"
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 700, generator=gen)
    lens = torch.tensor([700], dtype=torch.int32)
    indptr, indices = torch.tensor([0, 700], dtype=torch.int32), torch.arange(700, dtype=torch.int32)
    a = topk_select(x, lens, indptr, indices, 1, 50, block=128)
    b = topk_select(x, lens, indptr, indices, 1, 50, block=128, count="histogram")
    assert torch.equal(a.sort(1).values, b.sort(1).values)
    assert torch.equal(a.sort(1).values, x.topk(50, 1).indices.int().sort(1).values)


def test_bad_arguments():
    x = torch.zeros(2, 8)
    lens, indptr, indices = torch.tensor([8, 8], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), \
        torch.tensor([0, 1], dtype=torch.int32)
    batch = kvpool.DecodeBatch(indptr, indices, lens.clone(), lens, 8)
    with pytest.raises(ValueError, match=r"topk_impl='heap'; allowed: \['torch', 'triton', 'cuda'\] or None"):
        select_tokens(x, batch, 4, topk_impl="heap")
    with pytest.raises(ValueError, match=r"topk_impl='candidates' needs the logits kernel"):
        select_tokens(x, batch, 4, topk_impl="candidates")
    with pytest.raises(ValueError, match=r"logits has shape \(2, 7\); the batch needs \(2, >= 8\)"):
        select_tokens(x[:, :7], batch, 4, topk_impl="triton")
    cases = [
        (dict(logits=x.double()), "logits has dtype torch.float64"),
        (dict(kv_lens=lens.long()), "kv_lens has dtype torch.int64"),
        (dict(kv_indptr=indptr[:2]), "kv_indptr has 2 entries; expected B \\+ 1 = 3"),
        (dict(topk=0), "topk=0: must be a positive integer"),
        (dict(page_size=0), "page_size=0"),
        (dict(splits=0), "splits=0: must be an integer in 1..64, or None"),
        (dict(splits=2), "splits=2: more than 1 needs a GPU"),
        (dict(block=100), "block=100: must be a power of two in 16..32768"),
        (dict(digit_bits=3), "digit_bits=3: must be 2, 4 or 8"),
        (dict(count="sort"), r"count='sort'; allowed: \['histogram', 'atomic'\]"),
        (dict(count="match"), r"count='match'; allowed: \['histogram', 'atomic'\]"),
        (dict(logits=x.t().contiguous().t()), "logits rows must be contiguous"),
        (dict(sample=24), "sample=24: must be 0 or a power of two in 16..8192"),
        (dict(sample=16384), "sample=16384: must be 0 or a power of two"),
        (dict(sample=64, count="atomic"), r"sample=64 selects .* got splits=None, count='atomic'"),
        (dict(regs=100), "regs=100: must be 0 or a power of two in 16..8192"),
        (dict(regs=64, splits=2), r"regs=64 selects a short row in one program; got splits=2"),
    ]
    for change, msg in cases:
        args = dict(logits=x, kv_lens=lens, kv_indptr=indptr, kv_indices=indices, page_size=8, topk=4)
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            topk_select(**args)


def test_resident_per_sm_follows_sm90_occupancy_rules():
    """Programs an SM holds (scripts/sass_indexer.py's ``resident_per_sm``), worked by hand from sm_90's
    limits (64K registers allocated per warp in units of 256, 2048 threads, 228 KB of shared memory
    with 1 KB reserved a CTA, 32 CTAs). In its own process: importing the script turns the
    interpreter off for the process."""
    root = Path(__file__).resolve().parent.parent
    cases = [(181, 2048, 8), (101, 4096, 8), (64, 4096, 8), (32, 4096, 1), (32, 100 * 1024, 4), (255, 0, 4),
             (255, 0, 16)]
    code = ("import json, sys; sys.path.insert(0, 'scripts'); from sass_indexer import resident_per_sm; "
            f"print(json.dumps([resident_per_sm(*c) for c in {cases!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # 23 x 256 registers a warp: 11 warps' worth; 13 x 256: 19 warps; 8 x 256: 32 warps, 2048 threads
    # allow 8 CTAs; threads allow 64, the CTA limit is 32; shared memory: 233472 // (102400 + 1024);
    # 32 x 256 a warp: 8 warps; 16 warps of 255 registers do not fit an SM at all
    assert got == [1, 2, 4, 32, 2, 2, 0], got


def test_default_tiles_fit_one_program_an_sm(tmp_path):
    """scripts/sass_indexer.py in its own process (a real compile for sm_90; the interpreter is on
    here): at the launcher's defaults (4096-key tiles, 8 warps) an SM holds a program and nothing
    spills, which ``topk_select``'s bound (B * splits at most the SM count) relies on."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(root / "scripts" / "sass_indexer.py"), "topk"],
                         capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    st = json.loads(res.stdout)
    assert st["per_sm"] >= 1 and st["stack"] == 0, (st["regs"], st["shared"], st["stack"])


# -- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("context", [32768, 131072])
def test_gpu_glm5_topk_equals_torch_topk(context):
    """64 requests (one short, one of topk + 1, the rest up to ``context``), top-2048, page 64:
    every split setting, eager and replayed from a CUDA graph, against torch.topk's values."""
    topk, page_size, B = 2048, 64, 64
    gen = torch.Generator().manual_seed(context)
    lens = [700, topk + 1] + torch.randint(context // 2, context + 1, (B - 2,), generator=gen).tolist()
    lens[-1] = context
    pool_pages = sum(-(-n // page_size) for n in lens) + 8
    batch = kvpool.make_batch(pool_pages, page_size, lens, seed=1, device="cuda")
    x = torch.randn(B, context, device="cuda")
    x[3] = (2 * x[3]).exp()  # heavy tail
    x[4] = x[4].round()  # ties
    x[5, ::3] = -math.inf
    for kw in (dict(splits=1, count="histogram"), dict(splits=2, count="histogram"), dict(count="histogram"),
               dict(splits=1, count="atomic"), dict(count="atomic"), dict(sample=2048), dict(sample=256),
               dict(regs=4096), dict(sample=2048, regs=4096)):
        got = topk_select(x, batch.kv_lens, batch.kv_indptr, batch.kv_indices, page_size, topk, **kw)
        check_slots(batch, got)
        _assert_gpu(got, x, batch, topk)
    with pytest.raises(ValueError, match=r"splits=64: B \* splits = 4096 programs exceed the GPU's SMs"):
        topk_select(x, batch.kv_lens, batch.kv_indptr, batch.kv_indices, page_size, topk, splits=64)
    for kw in (dict(), dict(sample=2048)):
        graph, static = torch.cuda.CUDAGraph(), {}
        topk_select(x, batch.kv_lens, batch.kv_indptr, batch.kv_indices, page_size, topk, **kw)  # compiled, warm
        with torch.cuda.graph(graph):
            static["out"] = topk_select(x, batch.kv_lens, batch.kv_indptr, batch.kv_indices, page_size, topk, **kw)
        x.copy_(torch.randn_like(x))
        graph.replay()
        _assert_gpu(static["out"], x, batch, topk)


def _assert_gpu(slots, x, batch, topk):
    """Per long request, the logits at the slots, sorted, equal torch.topk's values over its context;
    short ones as select_tokens gives them (all tokens in order, then -1)."""
    pos = positions_of(batch, slots)
    long = torch.tensor(batch.lens_host, device=x.device) > topk
    assert (pos[long] >= 0).all(), "a slot outside its request's context"
    past = token_ids(batch, torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)) < 0
    want = torch.topk(x.masked_fill(past, -math.inf), topk, dim=1).values
    got = x.gather(1, pos.clamp_min(0)).sort(1, descending=True).values
    assert torch.equal(got[long], want[long]), "not the top-k"
    short = select_tokens(torch.zeros_like(x), batch, topk, check=False, topk_impl="torch")
    assert torch.equal(slots[~long], short[~long])
