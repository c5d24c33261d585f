"""Compile the DSA indexer's Triton kernels for sm_90 on any machine (no GPU: Triton's bundled ptxas)
and print registers, spill stack, shared memory, instruction counts and the programs an SM holds,
as JSON, at GLM-5's shapes (32 index heads x 128, KV pages of 64; integer arguments divisible by 16,
as Triton specializes them there).

    python scripts/sass_indexer.py topk [--warps 8] [--block 4096] [--splits 2]
    python scripts/sass_indexer.py logits [--tma] [--tiles 8] [--stages 2] [--warps 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # a real compile: the interpreter must not be active here
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402,F401  (aliases labkit.kernels in a plain checkout)
import triton  # noqa: E402
from sass_sm90 import stats  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from labkit.kernels import index_logits as IL  # noqa: E402
from labkit.kernels import topk_select as TS  # noqa: E402

FP32 = ("logits", "w_ptr", "s_ptr", "out_ptr", "crow_ptr", "seg_row_ptr")  # the other pointers: int32
FP8 = ("q_ptr", "k_ptr")
INTS = ("stride_l", "topk", "chunk", "stride_c", "max_len", "stride_kp", "stride_sp")


def compile_sm90(fn, consts: dict, num_warps: int, desc: str | None = None):
    """fn compiled for sm_90 with ``consts``; pointers 16-byte aligned, integers divisible by 16;
    ``k_desc`` a TMA descriptor of type ``desc``, or a plain fp8 pointer when None."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "k_desc" and desc:
            sig[name] = desc
        else:
            sig[name] = "i32" if name in INTS else "*fp32" if name in FP32 else \
                "*fp8e4nv" if name in FP8 or name == "k_desc" else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def resident_per_sm(n_regs: int, shared: int, num_warps: int, regs_per_sm: int = 65536, threads_per_sm: int = 2048,
                    smem_per_sm: int = 233472) -> int:
    """Programs of a compiled kernel that an SM holds at once (sm_90 rules: registers allocated
    per warp in units of 256, 1 KB of shared memory reserved a CTA, at most 32 CTAs)."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // warp_regs // num_warps
    by_threads = threads_per_sm // (32 * num_warps)
    by_smem = smem_per_sm // (shared + 1024)
    return max(0, min(by_regs, by_threads, by_smem, 32))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("topk", "logits"))
    ap.add_argument("--warps", type=int, help="num_warps (default: the launcher's, 8 for topk, 4 for logits)")
    ap.add_argument("--block", type=int, default=4096, help="topk: keys a tile")
    ap.add_argument("--splits", type=int, default=2, help="topk: programs a request")
    ap.add_argument("--tma", action="store_true", help="logits: keys by TMA (index_logits(tma=True))")
    ap.add_argument("--tiles", type=int, default=8, help="logits: tiles a program")
    ap.add_argument("--stages", type=int, default=2, help="logits: tiles in flight")
    a = ap.parse_args()
    if a.kernel == "topk":
        warps = a.warps or 8
        consts = dict(PAGE=64, BLOCK=a.block, CB=256, DB=8, SPLITS=a.splits, SP=triton.next_power_of_2(a.splits),
                      COUNT=0, REGS=0)
        cc = compile_sm90(TS._topk_radix_kernel, consts, warps)
    else:
        warps = a.warps or 4
        consts = dict(PAGE=64, IPAGE=64, D=128, H_PAD=32, BLOCK_T=64, TILES=a.tiles, NUM_STAGES=a.stages, CAND=0,
                      COPY=triton.next_power_of_2(64 * a.tiles), TMA=int(a.tma))
        cc = compile_sm90(IL._index_logits_kernel, consts, warps, "tensordesc<fp8e4nv[1, 64, 128]>" if a.tma else None)
    st, _ = stats(cc)
    st["per_sm"] = resident_per_sm(st["regs"], st["shared"], warps)
    print(json.dumps({k: v for k, v in st.items() if k != "ops"} | {"ops": st["ops"]}))


if __name__ == "__main__":
    main()
