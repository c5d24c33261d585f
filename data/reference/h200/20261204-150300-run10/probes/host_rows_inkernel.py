import sys, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from labkit import bench, backends, kvpool, timing, triton_plans
backends._load_optional()
NAMES = ["fp8_native.gluon", "fp8_native.gluon_acc", "fp8_native.triton_rows", "fp8_native.triton_rows_acc",
         "fp8_native.triton_q8", "full_pool_cast.triton", "gather_cast.triton", "bf16_pool.triton", "flashinfer_mla[bf16]"]
for shape in bench.GRIDS["gpu-host"]:
    pools = bench._pools(shape, "cuda", 0, 4)
    batch = bench._batch(shape, pools["fp8"], 1)
    qn, qp = kvpool.make_queries(shape.batch, shape.heads, device="cuda", seed=2)
    row = dict(heads=shape.heads)
    plans = {}
    for name in NAMES:
        try:
            b = backends.get(name.replace("[bf16]", ""))
        except Exception as e:
            row[name] = str(e)[:60]; continue
        pool = pools["bf16" if b.path == "bf16_pool" or "[bf16]" in name else "fp8"]
        plans[name] = b.plan(pool, batch, shape.heads, bench.SM_SCALE, qn.dtype).run
    for prec in ("fast", "accurate"):
        p = triton_plans.RowsPlan(pools["fp8"], batch, shape.heads, bench.SM_SCALE, qn.dtype, prec, q_pre=False)
        plans[f"rows_{prec}_inkernel"] = lambda q, r, layer, p=p: p(q, r, layer, batch)
    for name, run in plans.items():
        call = lambda layer: run(qn, qp, layer)
        h = [timing.host_us(call, layers=4, calls=50, repeats=5, warmup=3) for _ in range(2)]
        g = timing.graph_times(call, range(4)).us
        row[name] = (round(min(h), 1), round(g, 1))
    print(json.dumps(row), flush=True)
