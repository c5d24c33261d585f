"""A/B: the plain Gluon kernel's sparse slots from shared memory (new) against global loads in the
tile chain (prev, HEAD's file), alternating per shape, CUDA-graph medians over rotating layers."""
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
import gpu_kernels as gk  # noqa
import torch
from labkit import kvpool, reference, timing
from labkit.kernels import mla_decode_fp8_gluon as NEW
from labkit.kernels import mla_decode_fp8_gluon_prev as PREV
SHAPES = [(16, 64, "fp8_per_tensor"), (64, 64, "fp8_per_tensor"), (128, 128, "fp8_per_tensor"), (128, 64, "fp8_per_tensor"),
          (32, 64, "fp8_per_tensor"), (64, 1, "fp8_per_tensor"), (16, 64, "fp8_ds_mla"), (64, 64, "fp8_ds_mla"), (128, 128, "fp8_ds_mla")]
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for H, B, lay in SHAPES:
    L, topk = 32768, 2048
    pool = kvpool.random_pool(4, int(B * L * 1.05) // 64 * 64 + 64, 1, device="cuda", seed=H + B, kv_layout=lay)
    batch = kvpool.sparse_batch_for_pool(pool, [L] * B, topk, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    for prec in ("fast", "accurate"):
        for rnd in range(2):
            for name, mod in (("prev", PREV), ("new", NEW)):
                call = lambda layer, mod=mod: mod.mla_decode_fp8_gluon(qn, qp, pool.layer(layer), *idx, k_scale=1.0 if lay == "fp8_ds_mla" else pool.scale(layer),
                                                                   token_indices=batch.slots(0), precision=prec, kv_layout=lay)
                r = dict(kernel=name, round=rnd, H=H, B=B, kv_layout=lay, topk=topk, precision=prec,
                         rel_err=reference.rel_err(call(0), ref), graph_us=timing.graph_times(call, range(4)).us)
                rows.append(r); print(json.dumps(r), flush=True)
(out / "slots_ab.json").write_text(json.dumps(dict(env=gk.env_info(), rows=rows), indent=1))
