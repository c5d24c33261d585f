import sys, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import gpu_topk as G
from labkit import config
from labkit.indexer import logits_triton
from labkit.kernels.index_logits import auto_tiles
cfg = config.load_model("glm5")
class A: layers=4; replays=10; warmup=2; device="cuda"
for B, ctx in [(64, 32768), (1, 32768), (64, 8192), (64, 131072)]:
    case = G.Case(cfg, B, ctx, 4, "cuda"); L = case.logits; b = case.batch
    row = dict(B=B, ctx=ctx, auto=auto_tiles(B, ctx, 64, "cuda"))
    for tiles, ns in [(1, 1), (2, 2), (4, 2), (4, 3), (8, 3), (16, 3), (16, 4), (8, 2)]:
        f = lambda i, t=tiles, ns=ns: logits_triton(case.q_idx[i], case.weights[i], case.cache, i, b, tiles=t, num_stages=ns)
        x = f(0); fin = L[0] > -1e30
        assert torch.equal(x == float("-inf"), L[0] == float("-inf")) and torch.allclose(x[fin], L[0][fin], rtol=1e-5, atol=1e-6)
        row[f"t{tiles}s{ns}"] = round(G.graph_us(f, A), 1)
    row["auto"] = round(G.graph_us(lambda i: case.index(i), A), 1)
    row["topk"] = round(G.graph_us(lambda i: case.triton_topk(L[i]), A), 1)
    row["total"] = round(G.graph_us(lambda i: case.triton_topk(case.index(i)), A), 1)
    print(json.dumps(row), flush=True)
    del case; torch.cuda.empty_cache()
