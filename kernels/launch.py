"""Decode launch plans: what one batch fixes for a split-KV decode kernel, computed once.

A decode launcher does the same host work in every layer: validate, pick a config and a split
count, allocate the stage-1 partials, launch stage 1, merge. ``SplitKV`` keeps the part a batch
fixes (the split count, the partial buffers on the tensors' device, the merge's grid), so a layer
costs one output allocation and one or two launches: no checks, no device -> host read, nothing
a CUDA graph cannot capture. The kernels' own launchers stay the checked entry points; the plans
in ``labkit.triton_paths`` call the same kernels with the same arguments.

    sk = SplitKV.make(batch=B, heads=H, num_splits=S, out_dtype=torch.bfloat16, device=dev)
    out = sk.run(lambda o_buf, lse_buf, direct: kernel[grid](..., o_buf, lse_buf, ..., DIRECT=direct),
                 out_scale=v_scale)                                    # [B, H, 512]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton

from .mla_decode import D_CKV
from .mla_merge import _mla_merge_kernel


@dataclass
class SplitKV:
    """Stage-1 scratch and the merge of one batch's split-KV decode.

    part_o:   [B, H, S, 512] float32 partial outputs (S > 1), None when stage 1 writes the output
    part_lse: [B, H, S] float32 log2-sum-exp partials (S > 1), or [B, H] float32 lse (S == 1)
    lse:      [B, H] float32, the merged lse (kept here: decode returns the output only)
    """

    batch: int
    heads: int
    num_splits: int
    out_dtype: torch.dtype
    device: torch.device
    part_o: torch.Tensor | None
    part_lse: torch.Tensor
    lse: torch.Tensor
    merge_grid: tuple
    merge_meta: dict

    @classmethod
    def make(cls, batch: int, heads: int, num_splits: int, out_dtype: torch.dtype, device) -> "SplitKV":
        if num_splits < 1:
            raise ValueError(f"num_splits={num_splits}: must be >= 1")
        device = torch.device(device)
        lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
        if num_splits == 1:
            return cls(batch, heads, 1, out_dtype, device, None, lse, lse, (), {})
        part_o = torch.empty(batch, heads, num_splits, D_CKV, dtype=torch.float32, device=device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device)
        grid, meta = merge_launch(batch, heads, num_splits, out_dtype, device)
        return cls(batch, heads, num_splits, out_dtype, device, part_o, part_lse, lse, grid, meta)

    @property
    def direct(self) -> bool:
        return self.num_splits == 1

    def run(self, stage1: Callable, out_scale: float) -> torch.Tensor:
        """``stage1(o_buf, lse_buf, direct)`` launches stage 1; returns out [B, H, 512] ``out_dtype``
        (a new tensor every call: a layer's output outlives the next layer's call)."""
        out = torch.empty(self.batch, self.heads, D_CKV, dtype=self.out_dtype, device=self.device)
        if self.batch == 0:
            return out
        if self.direct:
            stage1(out, self.lse, True)
            return out
        stage1(self.part_o, self.part_lse, False)
        _mla_merge_kernel[self.merge_grid](
            self.part_o, self.part_lse, out, self.lse, self.heads, out.stride(0), out.stride(1),
            float(out_scale), self.num_splits, **self.merge_meta)
        return out


def merge_launch(batch: int, heads: int, num_splits: int, out_dtype, device) -> tuple[tuple, dict]:
    """The merge's grid and constexprs as ``mla_merge`` picks them (its default tiles)."""
    s_pow2 = triton.next_power_of_2(num_splits)
    if device.type == "cpu":  # the interpreter: as few programs as possible
        block_d, block_h = D_CKV, 16
    else:
        block_d = min(D_CKV, 128)
        block_h = max(1, 8192 // (s_pow2 * block_d))
    block_h = min(block_h, triton.next_power_of_2(heads))
    grid = (batch, triton.cdiv(heads, block_h), D_CKV // block_d)
    meta = dict(S_POW2=s_pow2, DV=D_CKV, BLOCK_H=block_h, BLOCK_D=block_d,
                RNE_BF16=(out_dtype == torch.bfloat16 and device.type == "cpu"), num_warps=4)
    return grid, meta
