"""The DSA lightning indexer (labkit.indexer, labkit.kernels.index_logits) against float64 math.

Logit tolerance, derived: q_idx and k_idx are e4m3 (4 significant bits), so each product q * k is
exact in fp32 and the only errors are fp32 roundings: D - 1 sums in a dot, one product by the head
weight, H - 1 sums over heads, one product by the key's scale. Whatever the summation order this
stays below (D + H + 2) * 2^-24 * M (first order), M = k_scale * sum_h |w_h| * sum_d |q_hd k_d|,
computed here in float64 per token. Top-k sets may then differ only among tokens whose reference
logits lie within twice that bound of the k-th largest (ties up to rounding).
"""
from __future__ import annotations

import math

import pytest
import torch

from labkit import config, kvpool, reference
from labkit.indexer import (INDEX_PAGE, Indexer, check_slots, index_bytes, index_flops, index_page_bytes,
                            logits_and_slots, quantize_index_keys, random_index_cache, sample_table, select_tokens)
from labkit.kernels.index_logits import index_logits

TINY = config.load_model("tiny")
U = 2.0**-24  # fp32 unit roundoff


def _case(page_size, lens, layers=2, seed=0, topk=32, cfg=TINY, device="cpu"):
    # the pool is a few pages larger than needed and its size is not a multiple of 64 at page size 1
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 3)
    pool = kvpool.random_pool(layers, ptok, page_size, seed=seed, device=device)
    batch = kvpool.batch_for_pool(pool, lens, seed=seed + 1)
    return Indexer(cfg, pool, batch, seed=seed, index_topk=topk)


def _ids(batch, b):
    """Global token ids of request b's context, in order, from its page list (a python loop)."""
    ps = batch.page_size
    ids = [int(p) * ps + s for p in batch.pages_of(b).tolist() for s in range(ps)]
    return ids[: batch.lens_host[b]]


def _bound(ix, layer, rel=None):
    """[B, max_len] float64 error bound of fp32 logits, rel * M with rel = (D + H + 2) * 2^-24 by
    default (module docstring); 0 past each length. On the CPU."""
    D, H = ix.cache.head_dim, ix.q_idx.shape[2]
    out = torch.zeros(ix.batch.batch_size, ix.batch.max_len, dtype=torch.float64)
    for b in range(ix.batch.batch_size):
        k, scale = ix.cache.keys(layer, torch.tensor(_ids(ix.batch, b), device=ix.pool.device))
        mag = ix.weights[layer, b].double().abs() @ (ix.q_idx[layer, b].double().abs() @ k.double().abs().T)
        out[b, : len(mag)] = ((D + H + 2) * U if rel is None else rel) * (scale.double() * mag).cpu()
    return out


def _check_logits(got, ref, bound):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert not got.isnan().any(), "unwritten or NaN logits"
    dead = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), dead) and (got[dead] < 0).all(), "-inf exactly past each length"
    err = (got.double() - ref).abs()[~dead]
    assert (err <= bound[~dead]).all(), f"max excess {(err - bound[~dead]).max():.3g}"


def _assert_topk_equiv(slots, ref, batch, topk, tol):
    """slots [B, topk] is a top-k of ``ref`` [B, max_len] (float64) up to ties within ``tol`` [B]."""
    for b, n in enumerate(batch.lens_host):
        ids = _ids(batch, b)
        row = slots[b].tolist()
        if n <= topk:
            assert row == ids + [-1] * (topk - n), "a short context gives all its tokens, then -1"
            continue
        assert -1 not in row and len(set(row)) == topk
        r = {t: float(ref[b, p]) for p, t in enumerate(ids)}
        kth = sorted(r.values(), reverse=True)[topk - 1]
        must_in = {t for t, v in r.items() if v > kth + tol[b]}
        must_out = {t for t, v in r.items() if v < kth - tol[b]}
        assert must_in <= set(row), "a token clearly above the k-th logit was dropped"
        assert not (must_out & set(row)), "a token clearly below the k-th logit was selected"



# -- the cache ---------------------------------------------------------------------------------
def test_index_cache_layout_bytes():
    pool = kvpool.random_pool(2, 200, 8, seed=3)
    cache = random_index_cache(pool, 128, seed=3)
    assert index_page_bytes(128) == 8448 == 64 * 128 + 64 * 4
    assert tuple(cache.buffer.shape) == (2, math.ceil(200 / INDEX_PAGE), 8448)
    assert cache.buffer.dtype == torch.uint8 and cache.tokens >= pool.pool_tokens
    for layer in (0, 1):
        for t in (0, 63, 64, 130, 199):
            page, row = cache.buffer[layer, t // 64], t % 64
            k, s = cache.keys(layer, torch.tensor([t]))
            assert torch.equal(page[row * 128 : (row + 1) * 128].view(torch.float8_e4m3fn), k[0].flatten())
            assert page[8192 + 4 * row : 8192 + 4 * row + 4].view(torch.float32).item() == s.item()
    assert not torch.equal(cache.k_idx(0), cache.k_idx(1)), "each layer has its own keys"
    same = random_index_cache(kvpool.random_pool(2, 200, 1, seed=9), 128, seed=3)
    assert torch.equal(same.buffer, cache.buffer), "keys depend on token ids, not on the KV page size"


def test_quantize_index_keys_per_token():
    x = torch.randn(50, 128, dtype=torch.float64) * torch.rand(50, 1, dtype=torch.float64) * 10
    k8, scale = quantize_index_keys(x)
    assert k8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (50,)
    assert torch.equal(k8.float().abs().amax(-1), torch.full((50,), 448.0)), "amax maps to 448"
    back = k8.double() * scale.double()[:, None]
    # e4m3 round to nearest: 2^-4 relative for normals, half the subnormal step 2^-10 below 2^-6
    tol = torch.maximum(x.abs() * 2.0**-4, scale.double()[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= tol).all()


def test_costs():
    cache = random_index_cache(kvpool.random_pool(1, 128, 64), 128)
    assert index_bytes(1000) == 1000 * cache.buffer[0].numel() // cache.tokens == 132_000
    assert index_flops(1000) == 2 * 32 * 128 * 1000
    ix = _case(16, [40, 90])
    assert ix.cost() == {"bytes": 130 * 132, "flops": 2 * TINY.index_n_heads * 128 * 130}


# -- logits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_logits_torch_and_triton_vs_reference(page_size, poisoned):
    lens = [1, 63, 64, 65, 300]
    ix = _case(page_size, lens, seed=page_size)
    for layer in range(ix.num_layers):
        ref = ix.logits(layer, "reference")
        assert ref.dtype == torch.float64 and tuple(ref.shape) == (len(lens), max(lens))
        bound = _bound(ix, layer)
        _check_logits(ix.logits(layer, "torch"), ref, bound)
        _check_logits(ix.logits(layer, "triton"), ref, bound)
    b = ix.batch  # several tiles per program: 3 x 32 positions, the 1-token request's programs mostly past it
    got = index_logits(ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), b.kv_indptr,
                       b.kv_indices, b.kv_lens, page_size, b.max_len, block_t=32, tiles=3)
    _check_logits(got, ix.logits(0, "reference"), _bound(ix, 0))
    if page_size % 64 == 0:  # whole index pages by TMA (a descriptor copy in the interpreter)
        for block_t in sorted({64, page_size}):
            got = index_logits(ix.q_idx[1], ix.weights[1], ix.cache.k_idx(1), ix.cache.k_scale(1), b.kv_indptr,
                               b.kv_indices, b.kv_lens, page_size, b.max_len, block_t=block_t, tiles=2, tma=True)
            _check_logits(got, ix.logits(1, "reference"), _bound(ix, 1))
    else:
        with pytest.raises(ValueError, match=f"tma=True reads tiles of whole index pages: .* page_size={page_size}"):
            index_logits(ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), b.kv_indptr,
                         b.kv_indices, b.kv_lens, page_size, b.max_len, block_t=64, tma=True)


def test_logits_follow_token_ids_not_pages():
    """The same tokens reached through pages of 64 or of 1 give the same logits."""
    ix64 = _case(64, [100, 130], seed=5)
    b64 = ix64.batch
    ids = [_ids(b64, b) for b in range(2)]
    pages = torch.tensor(ids[0] + ids[1], dtype=torch.int32)
    b1 = kvpool.DecodeBatch(torch.tensor([0, 100, 230], dtype=torch.int32), pages,
                            torch.ones(2, dtype=torch.int32), b64.kv_lens.clone(), 1)
    pool1 = kvpool.KVPool(ix64.pool.kv_buffer.flatten(1, 2).unsqueeze(2), ix64.pool.k_scale)
    ix1 = Indexer(TINY, pool1, b1, index_topk=32, cache=ix64.cache)
    ix1.q_idx, ix1.weights = ix64.q_idx, ix64.weights
    for impl in ("torch", "triton"):
        assert torch.equal(ix1.logits(1, impl), ix64.logits(1, impl))


def test_glm5_shapes_torch_and_triton():
    """32 heads x 128, top-2048: one request above top-k, one below."""
    cfg = config.load_model("glm5")
    ix = _case(64, [2500, 700], layers=1, seed=11, topk=cfg.index_topk, cfg=cfg)
    assert ix.q_idx.shape[2:] == (32, 128)
    ref, bound = ix.logits(0, "reference"), _bound(ix, 0)
    for impl in ("torch", "triton"):
        got = ix.logits(0, impl) if impl == "torch" else index_logits(
            ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), ix.batch.kv_indptr,
            ix.batch.kv_indices, ix.batch.kv_lens, 64, ix.batch.max_len, block_t=256)
        _check_logits(got, ref, bound)
        slots = select_tokens(got, ix.batch, 2048)
        _assert_topk_equiv(slots, ref, ix.batch, 2048, 2 * bound.amax(1))


# -- top-k slots -------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_topk_sets_match_reference(page_size):
    topk = 32
    lens = [5, 32, 33, 200, 257]
    ix = _case(page_size, lens, seed=20 + page_size, topk=topk)
    for layer in range(ix.num_layers):
        ref = ix.logits(layer, "reference")
        tol = 2 * _bound(ix, layer).amax(1)
        _assert_topk_equiv(ix.topk(layer, "reference"), ref, ix.batch, topk, torch.zeros(len(lens)))
        for impl in ("torch", "triton"):
            slots = ix.topk(layer, impl)
            assert slots.dtype == torch.int32 and tuple(slots.shape) == (len(lens), topk)
            _assert_topk_equiv(slots, ref, ix.batch, topk, tol)


@pytest.mark.parametrize("page_size,sample,run,tiles", [(1, 16, 1, 1), (16, 32, 1, 4), (64, 64, 1, 3), (16, 64, 16, 2)])
def test_logits_and_slots_from_candidates(page_size, sample, run, tiles):
    """The logits kernel's candidates (a threshold sampled per request) give the same logits and a
    top-k of the reference; short rows keep context order; a program of several tiles stages its
    candidates across them before its copy."""
    topk = 32
    lens = [5, 32, 33, 200, 700, 1]
    ix = _case(page_size, lens, seed=40 + page_size, topk=topk)
    table = sample_table(ix.batch, sample, run)
    assert table.kv_lens.tolist() == [min(n, sample) for n in lens]
    for layer in range(ix.num_layers):
        ref = ix.logits(layer, "reference")
        bound = _bound(ix, layer)
        logits, slots = logits_and_slots(ix.q_idx[layer], ix.weights[layer], ix.cache, layer, ix.batch, topk, table,
                                         tiles=tiles)
        _check_logits(logits, ref, bound)
        assert slots.dtype == torch.int32 and tuple(slots.shape) == (len(lens), topk)
        _assert_topk_equiv(slots, ref, ix.batch, topk, 2 * bound.amax(1))


@pytest.mark.parametrize("run", [1, 4, 16])
def test_sample_positions_spread_over_the_context(run):
    """Distinct positions inside each context, all of a short one; runs of consecutive positions
    that start at multiples of the run; evenly spread (run r starts within a run below r * n / runs)."""
    from labkit.kernels.topk_prefilter import sample_positions

    lens = [1, 10, 64, 65, 1000, 4099]
    pos, S = sample_positions(torch.tensor(lens, dtype=torch.int32), 64, run)
    assert S.tolist() == [min(n, 64) for n in lens]
    for b, n in enumerate(lens):
        p = pos[b]
        assert (p[S[b]:] == -1).all()
        v = p[: S[b]]
        assert len(set(v.tolist())) == len(v) and 0 <= v.min() and v.max() < n
        if n <= 64:
            assert v.tolist() == list(range(n))
            continue
        r = v.view(-1, run)
        assert (r[:, 0] % run == 0).all() and (r - r[:, :1] == torch.arange(run)).all()
        runs = 64 // run
        even = torch.arange(runs) * n // runs
        assert ((even - r[:, 0] >= 0) & (even - r[:, 0] < run)).all()
    with pytest.raises(ValueError, match="run=3"):
        sample_positions(torch.tensor([100], dtype=torch.int32), 64, 3)


def _one_launch_threshold_equals_two(ix, table, topk, layer=0, block_t=64):
    """kernels.index_sample against index_logits over the same table and sample_threshold: the same
    logits and thresholds, counts zeroed, the arrival counts back at zero. Returns the thresholds."""
    from labkit.kernels import topk_select as ts
    from labkit.kernels.index_sample import index_sample_threshold
    from labkit.kernels.topk_prefilter import sample_threshold

    b_, dev = ix.batch, ix.q_idx.device
    args = (ix.q_idx[layer], ix.weights[layer], ix.cache.k_idx(layer), ix.cache.k_scale(layer))
    want = index_logits(*args, table.kv_indptr, table.kv_indices, table.kv_lens, 1, table.sample, block_t=block_t)
    want_t16, _ = sample_threshold(want, b_.kv_lens, topk)
    sampled, t16, count = index_sample_threshold(*args, table.kv_indices, b_.kv_lens, table.sample, topk,
                                                 block_t=block_t)
    assert torch.equal(sampled, want) and torch.equal(t16, want_t16)
    assert not count.any() and not ts._barriers(dev, b_.batch_size).any()
    return t16


@pytest.mark.parametrize("block_t", [16, 64])
def test_sampled_threshold_in_one_launch_equals_two(block_t):
    """kernels.index_sample (the sampled logits, then the last program of a request writes the
    threshold) equals the two launches; a short request gets 65536 (none kept)."""
    ix = _case(16, [1000, 20, 64, 300], seed=9, topk=32)
    t16 = _one_launch_threshold_equals_two(ix, sample_table(ix.batch, 64, 4), 32, layer=1, block_t=block_t)
    assert t16[1] == 65536 and 0 < t16[0] < 65536


def test_candidates_threshold_keeps_few_and_falls_back():
    """The candidates of a long row are its logits at or above the sampled threshold (fewer than
    the row, at least topk); a threshold of 65536 keeps none and the fallback then keeps the whole
    row in context order."""
    from labkit.kernels.topk_prefilter import finish_candidates, sample_threshold

    topk, n, sample = 32, 1000, 64
    ix = _case(16, [n, 20], seed=7, topk=topk)
    b_, table = ix.batch, sample_table(ix.batch, sample)
    args = (ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0))
    sampled = index_logits(*args, table.kv_indptr, table.kv_indices, table.kv_lens, 1, sample)
    t16, count = sample_threshold(sampled, b_.kv_lens, topk)
    assert t16[1] == 65536 and count.tolist() == [0, 0]
    for forced in (None, 65536):
        if forced is not None:
            t16[0] = forced
            count.zero_()
        crow = torch.full((2, n), float("nan"))
        cslot = torch.full((2, n), -7, dtype=torch.int32)
        logits = index_logits(*args, b_.kv_indptr, b_.kv_indices, b_.kv_lens, 16, n,
                              candidates=(t16, crow, cslot, count), tiles=4)  # a program stages 4 tiles
        bits = logits[0].view(torch.int32)  # no -0.0 or NaN here: the key by its definition
        kept = (((bits ^ ((bits >> 31) | -2**31)) >> 16) & 0xFFFF) >= t16[0]
        if forced is None:
            assert count[0] == kept.sum() and topk <= count[0] < n // 4
        else:
            assert count[0] == 0
        crow, cslot, count, starts = finish_candidates(logits, b_.kv_lens, b_.kv_indptr, b_.kv_indices, 16, topk,
                                                       crow, cslot, count)
        assert starts.tolist() == [0, n, 2 * n]
        assert count[1] == 20 and cslot[1, :20].tolist() == _ids(b_, 1) and torch.equal(crow[1, :20], logits[1, :20])
        c = int(count[0])
        ids = torch.tensor(_ids(b_, 0))
        want = sorted(ids[kept].tolist()) if forced is None else ids.tolist()
        got = cslot[0, :c].tolist()
        assert (sorted(got) if forced is None else got) == want
        pos = {t: p for p, t in enumerate(ids.tolist())}
        assert torch.equal(crow[0, :c], logits[0, [pos[t] for t in got]])


def test_ties_at_kth_logit_any_choice():
    """Equal logits at the k-th place: any of the tied tokens may be taken."""
    batch = _case(16, [10]).batch
    logits = torch.tensor([[5.0, 1, 1, 1, 7, 1, 0, 0, 2, 1]])
    slots = select_tokens(logits, batch, 4)
    ids = _ids(batch, 0)
    picked = {ids.index(t) for t in slots[0].tolist()}
    assert {0, 4, 8} < picked and picked - {0, 4, 8} <= {1, 2, 3, 5, 9}


def test_step_slots_layers_differ_and_feed_decode_batch():
    ix = _case(16, [300, 20, 150], layers=3, seed=4, topk=64)
    step = ix.step_slots("triton")
    assert step.dtype == torch.int32 and tuple(step.shape) == (3, 3, 64)
    sparse = ix.batch.with_slots(step)
    assert sparse.topk == 64
    for layer in range(3):
        assert torch.equal(sparse.slots(layer), ix.topk(layer, "torch"))
    for b in (0, 2):  # contexts above top-k: each layer's own keys pick other tokens
        assert set(step[0, b].tolist()) != set(step[1, b].tolist())
    assert torch.equal(step[0, 1], step[2, 1]), "a short context gives all its tokens in every layer"
    check_slots(ix.batch, step, pool_tokens=ix.pool.pool_tokens)


def test_short_context_slots_attend_like_dense():
    """Slots covering a whole short context address exactly its rows: sparse attention over
    KVPool.rows at the slots equals the dense float64 oracle."""
    ix = _case(16, [7, 40, 33], seed=8, topk=48)
    slots = ix.topk(0)
    q_nope, q_pe = kvpool.make_queries(3, 4, seed=8, dtype=torch.float32)
    kv = ix.pool.dequant(0, torch.float64)  # [num_pages, page_size, 576]
    dense = reference.mla_decode(q_nope, q_pe, kv, ix.batch, 1 / 16)
    rows = kv.flatten(0, 1)
    q = torch.cat([q_nope, q_pe], -1).double()
    for b in range(3):
        sel = rows[slots[b][slots[b] >= 0].long()]
        p = torch.softmax(q[b] @ sel.T / 16, -1)
        assert reference.rel_err(p @ sel[:, :512], dense[b]) < 1e-12


# -- refusals ----------------------------------------------------------------------------------
def _bad(slots, b, j, value):
    """A copy of ``slots`` [B, topk] with slot j of request b set to ``value``."""
    s = slots.clone()
    s[b, j] = value
    return s


def test_check_slots_refusals():
    ix = _case(16, [40, 20], seed=2, topk=24)
    batch, good = ix.batch, ix.topk(0)
    check_slots(batch, good)
    other = _ids(batch, 1)[0]
    last_page = int(batch.pages_of(1)[-1])  # request 1 uses 4 of its last page's 16 slots
    cases = [
        (good.long(), "int32"),
        (good[:1], "1 requests; the batch has 2"),
        (_bad(good, 0, 3, -2), r"token_indices\[0, 3\].*-1 for an unused slot"),
        (_bad(good, 1, 5, -1), r"token_indices\[1, 6\].*follows a -1"),
        (_bad(good, 0, 0, other), r"token_indices\[0, 0\].*not one of the request's pages"),
        (_bad(good, 1, 0, last_page * 16 + 9), r"token_indices\[1, 0\].*past the request's context"),
        (_bad(good, 0, 1, int(good[0, 7])), f"request 0 lists token {int(good[0, 7])} twice"),
    ]
    for slots, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_slots(batch, slots)
    with pytest.raises(ValueError, match="past the pool's"):
        check_slots(batch, _bad(good, 0, 0, 10**6), pool_tokens=ix.pool.pool_tokens)
    step = torch.stack([good, _bad(good, 0, 2, int(good[0, 4]))])
    with pytest.raises(ValueError, match=r"request 0 \(layer 1\) lists token"):
        check_slots(batch, step)
    check_slots(batch, torch.tensor([[_ids(batch, 0)[3], -1], [other, -1]], dtype=torch.int32))  # hand-made


def test_bad_arguments():
    ix = _case(16, [40], topk=8)
    with pytest.raises(ValueError, match=r"impl='cuda'; allowed: \['reference', 'torch', 'triton'\]"):
        ix.logits(0, "cuda")
    with pytest.raises(ValueError, match="layer=2; allowed 0..1"):
        ix.logits(2)
    with pytest.raises(ValueError, match="index_topk=0"):
        select_tokens(ix.logits(0), ix.batch, 0)
    dense = config.ModelConfig("dense", 2, 16, 512, 64, 192, 256)
    with pytest.raises(ValueError, match="has no DSA indexer"):
        Indexer(dense, ix.pool, ix.batch)
    with pytest.raises(ValueError, match="tiles=0: must be an integer in 1..256"):
        index_logits(ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), ix.batch.kv_indptr,
                     ix.batch.kv_indices, ix.batch.kv_lens, 16, 40, tiles=0)
    with pytest.raises(ValueError, match="weights has dtype"):
        index_logits(ix.q_idx[0], ix.weights[0].double(), ix.cache.k_idx(0), ix.cache.k_scale(0),
                     ix.batch.kv_indptr, ix.batch.kv_indices, ix.batch.kv_lens, 16, 40)


# -- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size,block_t", [(64, 64), (1, 128), (16, 32)])
def test_gpu_glm5_logits_and_topk(page_size, block_t):
    """GLM-5 shapes on the device. Hopper's FP8 MMA keeps only about 14 mantissa bits in its
    accumulator (DeepSeek-V3 report), so the bound there is 2^-12 * M instead of ~2^-17 * M."""
    cfg = config.load_model("glm5")
    ix = _case(page_size, [1, 2047, 2048, 2049, 9000, 20000], layers=1, seed=12, topk=cfg.index_topk,
               cfg=cfg, device="cuda")
    ref, bound = ix.logits(0, "reference").cpu(), _bound(ix, 0, rel=2.0**-12)
    b = ix.batch
    got = index_logits(ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), b.kv_indptr,
                       b.kv_indices, b.kv_lens, page_size, b.max_len, block_t=block_t)
    extra = [index_logits(ix.q_idx[0], ix.weights[0], ix.cache.k_idx(0), ix.cache.k_scale(0), b.kv_indptr,
                          b.kv_indices, b.kv_lens, page_size, b.max_len, block_t=block_t, tma=True)] \
        if page_size % 64 == 0 and block_t in (64, 128) else []
    for logits in [got, ix.logits(0, "torch")] + extra:
        _check_logits(logits.cpu(), ref, bound)
        for topk_impl in (None, "cuda"):  # the default (Triton at 6 requests) and the CUDA C top-k
            slots = select_tokens(logits, b, cfg.index_topk, topk_impl=topk_impl)
            _assert_topk_equiv(slots.cpu(), ref, b.to("cpu"), cfg.index_topk, 2 * bound.amax(1))
    for sample in (256, 1024):  # the top-k's candidates from the logits kernel, eager and from a graph
        table = sample_table(b, sample)
        args = (ix.q_idx[0], ix.weights[0], ix.cache, 0, b, cfg.index_topk, table)
        _one_launch_threshold_equals_two(ix, table, cfg.index_topk)
        logits, slots = logits_and_slots(*args, block_t=block_t)
        _check_logits(logits.cpu(), ref, bound)
        _assert_topk_equiv(slots.cpu(), ref, b.to("cpu"), cfg.index_topk, 2 * bound.amax(1))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, g_slots = logits_and_slots(*args, block_t=block_t)
        graph.replay()
        torch.cuda.synchronize()
        _assert_topk_equiv(g_slots.cpu(), ref, b.to("cpu"), cfg.index_topk, 2 * bound.amax(1))
