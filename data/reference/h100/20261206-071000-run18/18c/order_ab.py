"""A/B: the Gluon kernels' grid with head blocks fastest (new: a request's two 64-head CTAs run side by
side and share its rows in L2) against requests fastest (prev, the committed files), alternating per
shape, CUDA-graph medians over rotating layers, each checked against the float64 oracle. The 16-head
rows (one head block) are the control; on fp8_ds_mla they also compare 8 warps (prev) with 4 (new)."""
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
import gpu_kernels as gk  # noqa
import torch
from labkit import kvpool, reference, timing
from labkit.kernels import mla_decode_fp8_gluon as NEW, mla_decode_fp8_ws as NEW_WS
from labkit.kernels import mla_decode_fp8_gluon_prev as PREV, mla_decode_fp8_ws_prev as PREV_WS
# (heads, requests, context, topk, layout, precisions, kernels)
SHAPES = [(128, 128, 32768, 2048, "fp8_per_tensor", ("fast", "accurate"), ("gluon",)),
          (128, 64, 32768, 2048, "fp8_per_tensor", ("fast",), ("gluon",)),
          (128, 128, 32768, 2048, "fp8_ds_mla", ("fast",), ("gluon",)),
          (128, 64, 8192, 0, "fp8_per_tensor", ("fast", "accurate"), ("gluon", "ws")),
          (128, 1, 8192, 0, "fp8_per_tensor", ("fast",), ("gluon", "ws")),
          (16, 64, 8192, 0, "fp8_per_tensor", ("fast",), ("gluon",)),
          (16, 64, 32768, 2048, "fp8_ds_mla", ("fast", "accurate"), ("gluon",))]
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for H, B, L, topk, lay, precs, kernels in SHAPES:
    page = 1 if topk else 64
    pool = kvpool.random_pool(4, int(B * L * 1.05) // 64 * 64 + 64, page, device="cuda", seed=H + B, kv_layout=lay)
    batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B) if topk else kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    kw = dict(token_indices=batch.slots(0), kv_layout=lay) if topk else dict(max_len=L)
    for kern in kernels:
        for prec in precs:
            if kern == "ws" and prec != "fast":
                continue
            for rnd in range(2):
                for name, fn in (("prev", PREV.mla_decode_fp8_gluon if kern == "gluon" else PREV_WS.mla_decode_fp8_ws),
                                 ("new", NEW.mla_decode_fp8_gluon if kern == "gluon" else NEW_WS.mla_decode_fp8_ws)):
                    call = lambda layer, fn=fn: fn(qn, qp, pool.layer(layer), *idx, precision=prec,
                                                   k_scale=1.0 if lay == "fp8_ds_mla" else pool.scale(layer), **kw)
                    r = dict(grid=name, kernel=kern, round=rnd, H=H, B=B, L=L, kv_layout=lay, topk=topk, precision=prec,
                             rel_err=reference.rel_err(call(0), ref), graph_us=timing.graph_times(call, range(4)).us)
                    rows.append(r); print(json.dumps(r), flush=True)
(out / "order_ab.json").write_text(json.dumps(dict(env=gk.env_info(), rows=rows), indent=1))
