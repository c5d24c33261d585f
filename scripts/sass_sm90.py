"""Compile the Gluon FP8 decode for sm_90 on any machine (no GPU: Triton's bundled ptxas) and print
what its SASS does, as JSON: registers, spill stack, shared memory, instruction counts. Read this
before spending GPU time on a change to the kernel.

    python scripts/sass_sm90.py [--block-h 16] [--stages 2] [--sass FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # a real compile: the interpreter must not be active here
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402,F401  (aliases labkit.kernels in a plain checkout)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402

from labkit.kernels import mla_decode_fp8_gluon as G  # noqa: E402
from labkit.kernels import mla_decode_fp8_ws as W  # noqa: E402

PTRS = dict(q_nope_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*fp8e4nv", rope_ptr="*bf16", scale_ptr="*fp32", kv_indptr_ptr="*i32", kv_indices_ptr="*i32",
            kv_lens_ptr="*i32", tok_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32")


def compile_sm90(block_h: int, stages: int, page: int = 64, sparse: bool = False, split: bool = False,
                 ds: bool = False, pipe: bool = False, ws: bool = False, warps: int | None = None,
                 slot_ring: bool | None = None):
    fn = W._mla_decode_fp8_ws_kernel if ws else G._mla_decode_fp8_gluon_kernel
    num_warps = 4 if ws else G.block_config(block_h, block_h, warps, "accurate" if split else "fast", sparse, ds)[1]
    consts = dict(PAGE=page, BLOCK_H=block_h, DIRECT=0, NUM_STAGES=stages, NUM_WARPS=num_warps, SPARSE=int(sparse), SPLIT=int(split),
                  DS=int(ds), PIPE=int(pipe), ROWS_LAG=W.ROWS_LAG,
                  SLOT_RING=int(G.use_slot_ring(sparse, ds, num_warps, slot_ring, "accurate" if split else "fast")))
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in PTRS:
            sig[name], attrs[(i,)] = PTRS[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    src = gluon._runtime.GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = dict(num_warps=num_warps, maxnreg=W.MAXNREG) if ws else dict(num_warps=num_warps)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def stats(cc) -> tuple[dict, str]:
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"])
        f.flush()
        sass = subprocess.run([bindir / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([bindir / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Za-z0-9_.]+)?)",
                                         sass, re.M))
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return dict(triton=triton.__version__, regs=int(m.group(1)), stack=int(m.group(2)), shared=cc.metadata.shared,
                instructions=sum(ops.values()), ops=dict(sorted(ops.items()))), sass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-h", type=int, default=16, choices=(16, 32, 64))
    ap.add_argument("--stages", type=int, default=G.GPU_CONFIG["num_stages"])
    ap.add_argument("--sparse", action="store_true", help="the sparse (token slots) variant")
    ap.add_argument("--accurate", action="store_true", help="precision='accurate': q and p as two e4m3 terms")
    ap.add_argument("--ds", action="store_true", help="sparse on fp8_ds_mla rows (656 bytes)")
    ap.add_argument("--pipe", action="store_true", help="the pipelined tile loop (pipeline=True)")
    ap.add_argument("--ws", action="store_true", help="the warp-specialized 64-head kernel (mla_decode_fp8_ws)")
    ap.add_argument("--warps", type=int, choices=(4, 8), help="num_warps (4 or 8 at 16-32 heads; default: the launcher's, G.default_warps)")
    ap.add_argument("--slot-ring", action="store_true", default=None,
                    help="sparse: the slots through the shared-memory ring (default: use_slot_ring's rule)")
    ap.add_argument("--sass", help="also write the SASS here")
    a = ap.parse_args()
    st, sass = stats(compile_sm90(a.block_h, a.stages, sparse=a.sparse, split=a.accurate, pipe=a.pipe, ds=a.ds, ws=a.ws,
                                     warps=a.warps, slot_ring=a.slot_ring))
    if a.sass:
        Path(a.sass).write_text(sass)
    print(json.dumps(st))


if __name__ == "__main__":
    main()
