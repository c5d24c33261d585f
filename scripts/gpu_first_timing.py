"""Why the first CUDA-graph timing after a float64 reference runs slow (runs 13 and 21: up to 16%).

One launch (the Gluon kernel, 16 heads, 64 x 8K, page 64) is timed by ``labkit.timing.graph_times``
several times in a row after each of these, with the SM / memory clocks, power and temperature that
nvidia-smi reports just before each timing:
  ref      the shape's float64 reference on the GPU (what gpu_gluon.py does before its variants)
  idle     two seconds of nothing
  fp32     a second of fp32 matmuls (power drawn without float64)
  alloc    a 4 GB allocation, freed and returned to the driver (torch.cuda.empty_cache)
A cause shows as a slow first timing after one of them and not after the others.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_first_timing.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels as gk  # noqa: E402  (aliases labkit.kernels in a plain checkout)

import torch  # noqa: E402

from labkit import kvpool, reference, timing  # noqa: E402
from labkit.kernels.mla_decode_fp8_gluon import mla_decode_fp8_gluon  # noqa: E402

LAYERS = 4


def smi() -> str:
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3, help="timings in a row after each event")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    H, B, L = 16, 64, 8192
    pool = kvpool.random_pool(LAYERS, int(B * L * 1.05) // 64 * 64 + 64, 64, device="cuda", seed=1)
    batch = kvpool.batch_for_pool(pool, [L] * B, seed=B)
    qn, qp = kvpool.make_queries(B, H, device="cuda", seed=H)

    def call(layer):
        return mla_decode_fp8_gluon(qn, qp, pool.layer(layer), batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                                    gk.SM_SCALE, k_scale=pool.scale(layer), max_len=L)

    def ref():
        reference.mla_decode(qn, qp, pool.dequant(0, torch.float64), batch, gk.SM_SCALE)
        torch.cuda.synchronize()

    def idle():
        torch.cuda.synchronize()
        time.sleep(2.0)

    def fp32():
        x = torch.randn(8192, 8192, device="cuda")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            x = (x @ x).clamp_(-1, 1)
            torch.cuda.synchronize()

    def alloc():
        x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
        x.zero_()
        del x
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    rows = []
    call(0)  # compiled
    for name, event in (("ref", ref), ("idle", idle), ("fp32", fp32), ("alloc", alloc), ("ref", ref), ("idle", idle)):
        event()
        for i in range(a.repeats):
            state = smi()
            us = timing.graph_times(call, range(LAYERS)).us
            rows.append(dict(after=name, nth=i + 1, graph_us=round(us, 2), smi_before=state))
            gk.log(json.dumps(rows[-1]))
    (out / "first_timing.json").write_text(json.dumps(dict(env=gk.env_info(), command=" ".join(sys.argv),
                                                           rows=rows), indent=1))


if __name__ == "__main__":
    main()
