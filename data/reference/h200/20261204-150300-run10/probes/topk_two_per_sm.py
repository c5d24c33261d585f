import sys, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import gpu_topk as G
from labkit import config
from labkit.kernels import topk_select as TS
cfg = config.load_model("glm5")
class A: layers=4; replays=10; warmup=2; device="cuda"
real = torch.cuda.get_device_properties
def regs():
    out = {}
    for dev, caches in TS._topk_radix_kernel.device_caches.items():
        for key, k in caches[0].items():
            out[str(k.metadata.num_warps) + "w/" + str(getattr(k.metadata, "shared", "?"))] = k.n_regs
    return out
for B, ctx in [(64, 32768), (64, 8192), (128, 32768), (64, 131072)]:
    case = G.Case(cfg, B, ctx, 4, "cuda"); L = case.logits; b = case.batch
    row = dict(B=B, ctx=ctx)
    f = lambda x, **kw: TS.topk_select(x, b.kv_lens, b.kv_indptr, b.kv_indices, b.page_size, case.topk, **kw)
    row["default"] = G.graph_us(lambda i: f(L[i]), A)
    for name, kw in {"b2k": dict(block=2048), "b1k": dict(block=1024)}.items():
        row[name] = G.graph_us(lambda i: f(L[i], **kw), A)
    print("regs", regs(), flush=True)
    # two programs per SM: only where the 8-warp kernel holds <= 128 registers
    class P:
        def __init__(s, p): s.p = p
        def __getattr__(s, a): return 2 * s.p.multi_processor_count if a == "multi_processor_count" else getattr(s.p, a)
    for name, kw in {"b2k_x2": dict(block=2048), "b1k_x2": dict(block=1024)}.items():
        spl = min(264 // B, 64)
        f(L[0], block=kw["block"], splits=max(1, 132 // B))  # compile at the safe split count first
        torch.cuda.synchronize()
        torch.cuda.get_device_properties = lambda d: P(real(d))
        try:
            ok = G.agreement(case, f(L[0], splits=spl, **kw), L[0])
            row[name] = G.graph_us(lambda i: f(L[i], splits=spl, **kw), A) if ok == B else f"BAD {ok}"
        finally:
            torch.cuda.get_device_properties = real
    print(json.dumps(row), flush=True)
    del case; torch.cuda.empty_cache()
