"""The warp-specialized 64-head Gluon decode (kernels/mla_decode_fp8_ws.py): its register relabelling
on the CPU, its sm_90 compile where Triton carries ptxas, and the float64 oracle on a Hopper GPU."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import kvpool, reference  # first: sets TRITON_INTERPRET on a CPU before triton loads
from labkit.kernels import mla_decode_fp8_gluon as G
from labkit.kernels import mla_decode_fp8_ws as W

import triton  # noqa: E402

from test_gluon import _v_layout_elements  # noqa: E402

SM = 1 / 16
ROOT = Path(__file__).resolve().parent.parent


def _col_of_row_h(m):
    """The V column (0..255 of a warpgroup's half) that row m of its out^T [256, 64] holds: the
    8-warp map with the warpgroup bit (m6) taken out."""
    return G._col_of_row8(((m >> 6) << 7) | (m & 63))


def _fragment_256(warp, lane):
    """(m, k) of the e4m3 A values a thread of one warpgroup holds for wgmma m64 k32, tiled over [256, 64]."""
    return {(64 * mt + 16 * warp + lane // 4 + 8 * (r % 2), 32 * kt + 4 * (lane % 4) + j + 16 * (r // 2))
            for mt in range(4) for kt in range(2) for r in range(4) for j in range(4)}


def test_half_v_layout_is_the_wgmma_fragment_relabelled():
    """Each consumer thread loads exactly the V values of its 256 columns that the MMA wants from it,
    8 adjacent bytes at a time."""
    assert sorted(_col_of_row_h(m) for m in range(256)) == list(range(256))
    for warp in range(4):
        for lane in range(32):
            want = {(G._token_of_k(k), _col_of_row_h(m)) for m, k in _fragment_256(warp, lane)}
            regs = _v_layout_elements(warp, lane, W.V_LAYOUT_BASES_H)
            assert set(regs) == want and len(regs) == 128
            for v in range(0, 128, 8):
                tok, col = regs[v]
                assert regs[v:v + 8] == [(tok, col + i) for i in range(8)] and col % 8 == 0


def test_half_relabel_reshapes_match_the_index_maps():
    col = torch.arange(256)[:, None].expand(256, 64)
    tok = torch.arange(64)[None, :].expand(256, 64)
    perm = (5, 0, 2, 6, 3, 1, 4, 7, 9, 8)
    assert col.reshape(W.V_SPLIT_H).permute(perm).reshape(256, 64)[:, 0].tolist() == [_col_of_row_h(m)
                                                                                      for m in range(256)]
    assert tok.reshape(W.V_SPLIT_H).permute(perm).reshape(256, 64)[0].tolist() == [G._token_of_k(k)
                                                                                   for k in range(64)]
    acc = torch.tensor([_col_of_row_h(m) for m in range(256)])[:, None].expand(256, 8)
    got = acc.reshape(*W.ACC_SPLIT_H, 8).permute(1, 5, 2, 4, 6, 0, 3, 7).reshape(256, 8)
    assert got[:, 0].tolist() == list(range(256))
    src = inspect.getsource(W)
    assert f"gl.reshape(vt, {list(W.V_SPLIT_H)})" in src and f"gl.permute(vt, {perm})" in src
    assert f"gl.reshape(acc, {list(W.ACC_SPLIT_H) + [64]})" in src
    assert "gl.permute(acc, (1, 5, 2, 4, 6, 0, 3, 7))" in src


@pytest.mark.skipif(not W.HAS_WS, reason="this Triton has no Gluon warp_specialize")
def test_compiles_for_sm90(tmp_path):
    """Three partitions; each consumer's code holds 18 score MMAs and 3 x 8 p @ V MMAs (64 heads on N),
    all e4m3 (V never widened); registers move from the producer to the consumers (setmaxnreg)."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_sm90.py"), "--ws", "--stages", "4"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    st = json.loads(res.stdout)
    assert st["ops"].get("QGMMA.64x64x32.F32.E4M3.E4M3", 0) >= 2 * (18 + 3 * 8), st["ops"]  # 3.7 peels one more
    assert st["ops"].get("USETMAXREG.TRY_ALLOC.CTAPOOL", 0) >= 1  # registers moved to the consumers
    assert not any(o.startswith(("HMMA", "HGMMA")) for o in st["ops"])


def test_preferred_where_it_measured_faster(monkeypatch):
    """The planned Gluon path takes the warp-specialized kernel for dense fast decode at more than 64
    heads with long splits (128 heads 64 x 8K: one 8K split a CTA), not at one request (66 splits of
    2 tiles), 64 heads, the accurate precision or the 656-byte layout; sparse slots where
    SPARSE_PREFERRED; and its splits are the 64-head Gluon config's."""
    from labkit.kernels import mla_decode as M
    monkeypatch.setattr(M, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert W.split_len(64, 128, 8192, cuda) == 8192 and W.split_len(1, 128, 8192, cuda) == 128
    assert W.preferred(128, "fp8_per_tensor", False, "fast", W.split_len(64, 128, 8192, cuda))
    assert W.preferred(100, "fp8_per_tensor", False, "fast", 32768)
    assert not W.preferred(128, "fp8_per_tensor", False, "fast", W.split_len(1, 128, 8192, cuda))
    for args in [(64, "fp8_per_tensor", False, "fast"), (128, "fp8_per_tensor", False, "accurate"),
                 (64, "fp8_per_tensor", True, "fast"), (128, "fp8_ds_mla", True, "fast")]:
        assert not W.preferred(*args, 8192), args
    # sparse top-2048 at 128 heads, 128 requests: one split of 32 tiles a CTA; one request: 32 splits of one
    assert W.split_len(128, 128, 2048, cuda) == 2048 and W.split_len(1, 128, 2048, cuda) == 64
    assert W.preferred(128, "fp8_per_tensor", True, "fast", W.split_len(128, 128, 2048, cuda)) == W.SPARSE_PREFERRED
    assert not W.preferred(128, "fp8_per_tensor", True, "fast", W.split_len(1, 128, 2048, cuda))
    _, _, wide = G.block_config(128)
    assert {k: wide[k] for k in ("ctas_per_sm", "min_tiles", "max_splits")} == \
        {k: W.GPU_CONFIG[k] for k in ("ctas_per_sm", "min_tiles", "max_splits")}


def test_refusals_name_the_rule():
    qn, qp = kvpool.make_queries(1, 64, seed=1)
    pool = kvpool.random_pool(1, 256, 64, seed=1)
    batch = kvpool.batch_for_pool(pool, [100], seed=1)
    with pytest.raises(ValueError, match="precision"):
        W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM,
                            precision="exact")
    with pytest.raises(ValueError, match="kv_buffer has dtype"):
        W.mla_decode_fp8_ws(qn, qp, pool.dequant(0, torch.bfloat16), batch.kv_indptr, batch.kv_indices,
                            batch.kv_lens, SM)
    slots = torch.zeros(1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows_lag=3"):
        W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM,
                            token_indices=slots, rows_lag=3)


# ------------------------------------------------------------------ GPU -------------------------
hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                                 and W.HAS_WS), reason="needs a Hopper (sm_90) GPU and Gluon warp_specialize")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("page_size,heads", [(64, 64), (128, 128), (64, 40), (64, 100)])
@pytest.mark.parametrize("precision", ["fast", "accurate", "fast_p16"])
def test_gpu_mla_decode_fp8_ws(page_size, heads, precision):
    """The oracle, with e4m3 NaN bytes (0x7F) past each request's end in its last page; splits of one
    tile (the second warpgroup owns none), of an odd and an even number of tiles; fast_p16: bf16 partials."""
    part_dtype = torch.bfloat16 if precision == "fast_p16" else None
    precision = precision.removesuffix("_p16")
    lens = [1, page_size - 1, page_size, page_size + 1, 4097, 1000, 130]
    ptok = page_size * (sum(-(-n // page_size) for n in lens) + 3)
    pool = kvpool.random_pool(1, ptok, page_size, seed=heads, device="cuda")
    batch = kvpool.batch_for_pool(pool, lens, seed=heads + 1)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=heads + 2, device="cuda")
    ref, ref_lse = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM, return_lse=True)
    raw = pool.layer(0).view(torch.uint8)
    for b, n in enumerate(lens):
        raw[int(batch.kv_indices[int(batch.kv_indptr[b + 1]) - 1]), (n - 1) % page_size + 1:] = 0x7F
    tol = 3e-3 if precision == "accurate" else 5e-2
    stages = 3 if precision == "accurate" else None
    for splits in (None, 1, 7, 64):
        out, lse = W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices,
                                       batch.kv_lens, SM, pool.scale(0), num_splits=splits, return_lse=True,
                                       precision=precision, num_stages=stages, part_dtype=part_dtype)
        assert out.dtype == qn.dtype and out.shape == qn.shape and torch.isfinite(out).all()
        assert reference.rel_err(out, ref) < tol, (splits, reference.rel_err(out, ref))
        assert float((lse.double().cpu() - ref_lse.cpu()).abs().max()) < 0.2


@pytest.mark.gpu
@hopper
def test_gpu_planned_gluon_path_takes_it_at_128_heads():
    """fp8_native.gluon at 128 heads with one 16-tile split a CTA (66 requests of 1024 tokens fill the
    132 SMs' wave): the plan gives the same numbers as this kernel's launcher, within the
    fast precision's error of the oracle."""
    from labkit import backends
    lens = [1024] * 66
    pool = kvpool.random_pool(1, 64 * (16 * 66 + 4), 64, seed=3, device="cuda")
    batch = kvpool.batch_for_pool(pool, lens, seed=4)
    qn, qp = kvpool.make_queries(len(lens), 128, seed=5, device="cuda")
    assert W.preferred(128, "fp8_per_tensor", False, "fast", W.split_len(66, 128, 1024, qn.device))
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM)
    want = W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM,
                               pool.scale(0))
    assert reference.rel_err(want, ref) < 5e-2
    be = backends.get("fp8_native.gluon")
    assert torch.equal(be.plan(pool, batch, 128, SM, qn.dtype).run(qn, qp, 0), want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("page_size,heads", [(1, 128), (1, 64), (64, 100), (16, 128)])
@pytest.mark.parametrize("precision", ["fast", "accurate"])
def test_gpu_mla_decode_fp8_ws_sparse(page_size, heads, precision):
    """Token slots in random order, rows by the producer warpgroup's cp.async: the oracle over the valid
    slots, with -1 slots anywhere (a whole leading tile of them), a request whose slots are all -1
    past 17, topk not a multiple of the tile, and splits of one tile to the whole request."""
    lens, topk = [3000, 17, 4096, 700, 2500], 1000
    pool = kvpool.random_pool(1, page_size * (sum(-(-n // page_size) for n in lens) + 3), page_size, seed=heads,
                              device="cuda")
    batch = kvpool.sparse_batch_for_pool(pool, lens, topk, seed=heads + 1)
    slots = batch.slots(0).clone()
    slots[0, :70] = -1
    slots[2, 100::7] = -1
    batch = batch.with_slots(slots)
    qn, qp = kvpool.make_queries(len(lens), heads, seed=heads + 2, device="cuda")
    ref, ref_lse = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM, return_lse=True)
    tol = 3e-3 if precision == "accurate" else 5e-2
    stages = 3 if precision == "accurate" else None
    for splits in (None, 1, 5, 16):
        out, lse = W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                                       SM, pool.scale(0), num_splits=splits, return_lse=True, token_indices=slots,
                                       precision=precision, num_stages=stages)
        err = reference.rel_err(out, ref)
        assert torch.isfinite(out).all() and err < tol, (splits, err)
        assert float((lse.double().cpu() - ref_lse.cpu()).abs().max()) < 0.2


@pytest.mark.gpu
@hopper
def test_gpu_planned_gluon_path_sparse_at_128_heads():
    """fp8_native.gluon on a sparse batch at 128 heads (66 requests x top-1024: one 16-tile split a CTA):
    the plan gives this kernel's numbers (where SPARSE_PREFERRED), within the fast precision of the oracle."""
    from labkit import backends
    lens = [3000] * 66
    pool = kvpool.random_pool(1, 3000 * 66 + 64, 1, seed=6, device="cuda")
    batch = kvpool.sparse_batch_for_pool(pool, lens, 1024, seed=7)
    qn, qp = kvpool.make_queries(len(lens), 128, seed=8, device="cuda")
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, SM)
    want = W.mla_decode_fp8_ws(qn, qp, pool.layer(0), batch.kv_indptr, batch.kv_indices, batch.kv_lens, SM,
                               pool.scale(0), token_indices=batch.slots(0))
    assert reference.rel_err(want, ref) < 5e-2
    got = backends.get("fp8_native.gluon").plan(pool, batch, 128, SM, qn.dtype).run(qn, qp, 0, batch.slots(0))
    assert reference.rel_err(got, ref) < 5e-2
    assert torch.equal(got, want) == W.SPARSE_PREFERRED
