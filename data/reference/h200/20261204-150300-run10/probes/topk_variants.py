import sys, json, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import gpu_topk as G
from labkit import config, timing
from labkit.kernels.topk_select import topk_select as topk_radix  # kernels/topk_radix.py then
cfg = config.load_model("glm5")
class A: layers=4; replays=10; warmup=2; device="cuda"
VAR = {"a16": dict(num_warps=16), "a8": dict(num_warps=8), "a8_db8": dict(num_warps=8, digit_bits=8),
       "a16_db8": dict(num_warps=16, digit_bits=8), "s1_16": dict(splits=1, num_warps=16), "a32": dict(num_warps=32)}
rows = []
for B, ctx in [(1, 32768), (64, 32768), (1, 8192), (1, 131072), (64, 8192), (128, 32768)]:
    case = G.Case(cfg, B, ctx, 4, "cuda"); L = case.logits; b = case.batch
    row = dict(B=B, ctx=ctx)
    row["logits"] = G.graph_us(lambda i: case.index(i), A)
    row["zeros"] = G.graph_us(lambda i: torch.zeros(1, dtype=torch.int32, device="cuda"), A)
    row["torch_topk"] = G.graph_us(lambda i: torch.topk(L[i], case.topk, dim=1, sorted=False), A)
    from labkit.kernels.topk_select import auto_splits
    row["auto_splits"] = auto_splits(B, ctx, "cuda")
    for name, kw in VAR.items():
        if kw == "half": kw = dict(num_warps=8, splits=max(1, row["auto_splits"] // 2))
        f = lambda x, kw=kw: topk_radix(x, b.kv_lens, b.kv_indptr, b.kv_indices, b.page_size, case.topk, **kw)
        ok = G.agreement(case, f(L[0]), L[0])
        row[name] = G.graph_us(lambda i: f(L[i]), A) if ok == B else f"BAD {ok}/{B}"
    print(json.dumps(row), flush=True); rows.append(row)
    del case; torch.cuda.empty_cache()
