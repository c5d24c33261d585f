"""The Gluon FP8 decode (kernels/mla_decode_fp8_gluon.py: both products as FP8 wgmma, V as a
register operand) beside the TMA kernel, the pointer-gather FP8 kernel and the BF16-pool kernel, on
one GPU, with ``gpu_tma.py``'s method: oracle checks (NaN-poisoned outputs, NaN bytes past each
request's end; 8, 16 and 32 heads; page sizes 64 and 128), then do_bench and CUDA-graph medians of
whole calls per variant and shape (L2 flushed), ratios against the BF16-pool kernel.

    PYTHONUNBUFFERED=1 LAB_GIT_REV=$(git rev-parse HEAD) python3 scripts/gpu_gluon.py --out DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_tma  # noqa: E402

gpu_tma.VARIANTS = {
    "bf16.pipe32": ("bf16", dict(block_n=32, num_warps=4, num_stages=3)),
    "fp8.default": ("gather", dict()),
    "tma.default": ("tma", dict()),
    "gluon.s2_c2": ("gluon", dict(num_stages=2, ctas_per_sm=2)),
    "gluon.s2_c1": ("gluon", dict(num_stages=2, ctas_per_sm=1)),
    "gluon.s4_c1": ("gluon", dict(num_stages=4, ctas_per_sm=1)),
    "gluon.s3_c1": ("gluon", dict(num_stages=3, ctas_per_sm=1)),
    "gluon.default": ("gluon", dict()),  # 2 stages, 2 CTAs per SM
}
gpu_tma.SHAPES = [(16, 64, 8192), (8, 64, 8192), (16, 128, 8192), (16, 32, 32768), (8, 128, 16384),
                  (32, 64, 8192), (16, 1, 8192)]
gpu_tma.CHECKS = [(16, 64), (8, 64), (32, 64), (16, 128)]
gpu_tma.STEM = "gpu_gluon"

if __name__ == "__main__":
    gpu_tma.main()
