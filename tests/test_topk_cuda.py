"""labkit.kernels.topk_cuda: the indexer's top-k in CUDA C. On a CPU: its argument checks, and its
source through nvcc (where this machine has one: it compiles for sm_90 with no spill). On a GPU:
every kind of row against float64 sorting, each tuning, rows kept in shared memory and rows read
from global memory, short requests, a CUDA graph's replay, and GLM-5's shapes against torch.topk."""
from __future__ import annotations

import math
import re
import shutil
import subprocess

import pytest
import torch

from labkit import kvpool
from labkit.indexer import check_slots, select_tokens
from labkit.kernels import topk_cuda as mod
from labkit.kernels.topk_cuda import MAX_CAP, topk_cuda

from test_topk_select import _assert_gpu, _assert_topk, _rows, _table

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _args(lens, page_size, T=None, device="cpu"):
    indptr, indices = _table(lens, page_size)
    x = torch.randn(len(lens), T or max(lens), device=device)
    return x, torch.tensor(lens, dtype=torch.int32, device=device), indptr.to(device), indices.to(device)


def test_bad_arguments():
    """Refused by name before any work, on any device."""
    x, lens, indptr, indices = _args([40, 30], 4)
    cases = [
        (dict(logits=x.double()), r"logits has dtype torch.float64; expected torch.float32"),
        (dict(logits=x[0]), r"logits must be a 2-D tensor"),
        (dict(kv_lens=lens[:1]), r"kv_lens has 1 entries; logits has B = 2 rows"),
        (dict(kv_indptr=indptr[:2]), r"kv_indptr has 2 entries; expected B \+ 1 = 3"),
        (dict(kv_indices=indices.long()), r"kv_indices has dtype torch.int64"),
        (dict(logits=x.t().contiguous().t()), r"logits rows must be contiguous"),
        (dict(topk=0), r"topk=0: must be a positive integer"),
        (dict(page_size=True), r"page_size=True: must be a positive integer"),
        (dict(threads=100), r"threads=100: must be 128, 256, 512 or 1024"),
        (dict(digit_bits=13), r"digit_bits=13: must be an integer in 8..12"),
        (dict(unroll=3), r"unroll=3: must be 1, 2, 4 or 8"),
        (dict(sample=512), r"sample=512: must be 0, 1024, 2048 or 4096"),
        (dict(), r"topk_cuda runs on a CUDA device; logits are on cpu"),
    ]
    base = dict(logits=x, kv_lens=lens, kv_indptr=indptr, kv_indices=indices, page_size=4, topk=8)
    for kw, msg in cases:
        a = {**base, **kw}
        extra = {k: a.pop(k) for k in ("threads", "digit_bits", "unroll", "sample") if k in a}
        with pytest.raises(ValueError, match=msg):
            topk_cuda(a["logits"], a["kv_lens"], a["kv_indptr"], a["kv_indices"], a["page_size"], a["topk"], **extra)


def test_select_tokens_names_cuda():
    """"cuda" is a top-k of select_tokens; an unknown name lists it."""
    batch = kvpool.make_batch(8, 4, [20, 9], seed=0)
    with pytest.raises(ValueError, match=r"topk_impl='heap'; allowed: \['torch', 'triton', 'cuda'\] or None"):
        select_tokens(torch.zeros(2, 20), batch, 4, topk_impl="heap")
    with pytest.raises(ValueError, match="topk_cuda runs on a CUDA device"):
        select_tokens(torch.zeros(2, 20), batch, 4, topk_impl="cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("kw", [dict(), dict(agg=True, threads=256, digit_bits=8, unroll=2, sample=0)])
def test_source_compiles_for_sm90_without_spills(tmp_path, kw):
    """The source NVRTC gets, through nvcc: it compiles for sm_90, no stack, no spill."""
    src = tmp_path / "topk.cu"
    src.write_text(mod.source(**kw))
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", str(src), "-o", str(tmp_path / "t.cubin")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", r.stderr), r.stderr


# -- on a GPU ----------------------------------------------------------------------------------
TUNINGS = [dict(), dict(agg=True), dict(threads=256), dict(digit_bits=8), dict(digit_bits=12, unroll=1),
           dict(cache=False), dict(threads=128, agg=True, unroll=8), dict(sample=0), dict(sample=2048, cache=False)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kw", TUNINGS)
def test_gpu_every_kind_of_row(kw):
    """_rows' kinds (ties at the k-th, all negative, -inf, all equal, a heavy tail, outliers, NaN) at
    top-2048 of 20000, short lengths, and rows that the sampled threshold misjudges, against float64
    sorting; pages of 16."""
    T, topk, page = 20000, 2048, 16
    lens = [20000, 19000, 2049, 15000, 9000, 20000, 12000, 17000, 0, 1, 2048, 20000, 20000]
    x = torch.cat([_rows(T, torch.Generator().manual_seed(7)), torch.randn(5, T)])
    x[11, ::9] += 100.0  # the sample (every 9th key) sees only large keys: too few reach its threshold
    x[12, ::9] -= 100.0  # it sees only small ones: too many reach it; both fall back to the full rounds
    indptr, indices = _table(lens, page, seed=3)
    got = topk_cuda(x.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), indptr.cuda(), indices.cuda(), page,
                    topk, **kw)
    _assert_topk(got.cpu(), x, lens, indptr, indices, page, topk)


@pytest.mark.gpu
@gpu
def test_gpu_rows_past_shared_memory_and_full_candidate_bins():
    """Rows longer than max_cache (read from global memory each round), a bin of more than MAX_CAP
    keys tied at the k-th (every bit fixed on the row), a narrow range of many close values, page 1."""
    T = mod.max_cache(torch.device("cuda")) + 5000
    topk, page = 2048, 1
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, T, generator=g)
    x[1, : MAX_CAP + 1000] = 0.5  # more ties straddling the k-th than candidates fit
    x[1, MAX_CAP + 1000:] = -x[1, MAX_CAP + 1000:].abs()
    x[1, -1000:] = 1.0
    x[2] = 1.0 + torch.randint(0, 4000, (T,), generator=g) * 2.0 ** -23  # 4000 neighbouring floats
    x[3, ::7] = math.inf
    lens = [T, T, T - 3, T]
    indptr, indices = _table(lens, page, seed=4)
    for kw in (dict(), dict(cache=False, agg=True)):
        got = topk_cuda(x.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), indptr.cuda(), indices.cuda(), page,
                        topk, **kw)
        _assert_topk(got.cpu(), x, lens, indptr, indices, page, topk)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("context", [32768, 131072])
def test_gpu_glm5_topk_cuda_equals_torch_topk(context):
    """64 requests up to ``context``, top-2048, page 64, as the Triton top-k's GPU test: eager,
    through select_tokens, and replayed from a CUDA graph with new logits."""
    topk, page_size, B = 2048, 64, 64
    gen = torch.Generator().manual_seed(context)
    lens = [700, topk + 1] + torch.randint(context // 2, context + 1, (B - 2,), generator=gen).tolist()
    lens[-1] = context
    batch = kvpool.make_batch(sum(-(-n // page_size) for n in lens) + 8, page_size, lens, seed=1, device="cuda")
    x = torch.randn(B, context, device="cuda")
    x[3] = (2 * x[3]).exp()
    x[4] = x[4].round()
    x[5, ::3] = -math.inf
    args = (batch.kv_lens, batch.kv_indptr, batch.kv_indices, page_size, topk)
    got = topk_cuda(x, *args)
    check_slots(batch, got)
    _assert_gpu(got, x, batch, topk)
    _assert_gpu(select_tokens(x, batch, topk, topk_impl="cuda"), x, batch, topk)
    graph, static = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        static["out"] = topk_cuda(x, *args)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _assert_gpu(static["out"], x, batch, topk)
