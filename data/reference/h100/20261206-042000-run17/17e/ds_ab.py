"""A/B/C on fp8_ds_mla rows: the plain Gluon kernel as committed (prev), with the group-wise in-place V
rescale (v2), and with it plus the slot ring at 64 heads a CTA (v3, the working file); two alternating
rounds, CUDA-graph medians over rotating layers, each checked against the float64 oracle."""
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
import gpu_kernels as gk  # noqa
import torch
from labkit import kvpool, reference, timing
from labkit.kernels import mla_decode_fp8_gluon as V3
from labkit.kernels import mla_decode_fp8_gluon_prev as PREV
from labkit.kernels import mla_decode_fp8_gluon_v2 as V2
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for H, B in [(64, 64), (128, 128), (16, 64)]:
    L, topk, lay = 32768, 2048, "fp8_ds_mla"
    pool = kvpool.random_pool(4, int(B * L * 1.05) // 64 * 64 + 64, 1, device="cuda", seed=H + B, kv_layout=lay)
    batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    for prec in ("fast", "accurate"):
        for rnd in range(2):
            for name, mod in (("prev", PREV), ("v2", V2), ("v3", V3)):
                call = lambda layer, mod=mod: mod.mla_decode_fp8_gluon(qn, qp, pool.layer(layer), *idx, k_scale=1.0,
                                                                   token_indices=batch.slots(0), precision=prec, kv_layout=lay)
                r = dict(kernel=name, round=rnd, H=H, B=B, kv_layout=lay, topk=topk, precision=prec,
                         rel_err=reference.rel_err(call(0), ref), graph_us=timing.graph_times(call, range(4)).us)
                rows.append(r); print(json.dumps(r), flush=True)
(out / "ds_ab.json").write_text(json.dumps(dict(env=gk.env_info(), rows=rows), indent=1))
