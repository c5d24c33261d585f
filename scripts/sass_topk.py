"""Compile the grid top-k's kernels (labkit.kernels.topk_grid) for sm_90 on any machine (no GPU:
Triton's bundled ptxas) and print, as JSON, each kernel's registers, spill stack, shared memory and
instruction count. Read this before spending GPU time on a change to them.

    python scripts/sass_topk.py [--block 4096] [--warps 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # a real compile: the interpreter must not be active here
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_sm90  # noqa: E402  (its stats(); it aliases labkit.kernels in a plain checkout)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from labkit.kernels import topk_grid as TG  # noqa: E402

ROW = dict(logits="*fp32", stride_l="i32", lens="*i32")


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int):
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def kernels(block: int):
    """(name, jit function, signature, constexprs) of the six launches' kernels (four rounds share one)."""
    out = [(f"round{r}", TG._topk_grid_round_kernel, dict(**ROW, hist="*i32", topk="i32"),
            dict(ROUND=r, BLOCK=block, FEW=TG.FEW)) for r in range(4)]
    out.append(("count", TG._topk_grid_count_kernel, dict(**ROW, hist="*i32", kq="*i32", counts="*i32", topk="i32",
                                                         P="i32"), dict(BLOCK=block)))
    out.append(("write", TG._topk_grid_write_kernel, dict(**ROW, indptr="*i32", indices="*i32", hist="*i32", kq="*i32",
                                                         counts="*i32", out="*i32", topk="i32", P="i32"),
                dict(BLOCK=block, PP=8, PAGE=64)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args()
    res = {}
    for name, fn, sig, consts in kernels(a.block):
        st, _ = sass_sm90.stats(compile_sm90(fn, sig, consts, a.warps))
        res[name] = {k: v for k, v in st.items() if k != "ops"}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
