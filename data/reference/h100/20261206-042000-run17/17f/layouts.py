"""The plain Gluon kernel on both FP8 layouts, top-2048 of 32K, the same slots: CUDA-graph medians."""
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
import gpu_kernels as gk  # noqa
import torch
from labkit import kvpool, reference, timing
from labkit.kernels import mla_decode_fp8_gluon as G
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for H, B in [(16, 64), (64, 64), (128, 128)]:
    L, topk = 32768, 2048
    for lay in ("fp8_per_tensor", "fp8_ds_mla"):
        pool = kvpool.random_pool(4, int(B * L * 1.05) // 64 * 64 + 64, 1, device="cuda", seed=H + B, kv_layout=lay)
        batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B)
        qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
        ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
        idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
        for prec in ("fast", "accurate"):
            ks = (lambda l: 1.0) if lay == "fp8_ds_mla" else pool.scale
            call = lambda layer: G.mla_decode_fp8_gluon(qn, qp, pool.layer(layer), *idx, k_scale=ks(layer),
                                                        token_indices=batch.slots(0), precision=prec, kv_layout=lay)
            r = dict(H=H, B=B, kv_layout=lay, topk=topk, precision=prec, rel_err=reference.rel_err(call(0), ref),
                     graph_us=timing.graph_times(call, range(4)).us)
            rows.append(r); print(json.dumps(r), flush=True)
        del pool
(out / "layouts.json").write_text(json.dumps(dict(env=gk.env_info(), rows=rows), indent=1))
