"""Is the first CUDA-graph timing after a new pool slower? Same call timed repeatedly."""
import sys, json, time
from pathlib import Path
sys.path.insert(0, "scripts")
import gpu_kernels as gk
import torch
from labkit import kvpool, reference, timing
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon

H, B, L, LAYERS = 16, 64, 8192, 4
out = []
def case(seed):
    rows = int(B * L * 1.05) // 64 * 64 + 64
    pool = kvpool.random_pool(LAYERS, rows, 64, device="cuda", seed=seed)
    batch = kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)
    idx = (batch.kv_indptr, batch.kv_indices, batch.kv_lens, gk.SM_SCALE)
    call = lambda layer: mla_decode_fp8_gluon(qn, qp, pool.layer(layer), *idx, k_scale=pool.scale(layer), max_len=L)
    return pool, batch, qn, qp, call
def rec(tag, us):
    out.append((tag, round(us, 1))); print(tag, round(us, 1), flush=True)

pool, batch, qn, qp, call = case(1)
ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
for i in range(4):
    rec(f"A after ref, graph {i}", timing.graph_times(call, range(LAYERS)).us)
for i in range(2):
    rec(f"A replays=200 {i}", timing.graph_times(call, range(LAYERS), replays=200, warmup=20).us)
del pool, call; torch.cuda.empty_cache()
pool, batch, qn, qp, call = case(2)
for i in range(3):
    rec(f"B new pool no ref, graph {i}", timing.graph_times(call, range(LAYERS)).us)
ref = reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
for i in range(3):
    rec(f"B after ref, graph {i}", timing.graph_times(call, range(LAYERS)).us)
time.sleep(2)
for i in range(2):
    rec(f"B after 2 s idle, graph {i}", timing.graph_times(call, range(LAYERS)).us)
timing.bench(lambda: call(0))
rec("B after do_bench, graph", timing.graph_times(call, range(LAYERS)).us)
print(json.dumps(out))
