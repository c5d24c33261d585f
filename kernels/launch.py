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

``Launcher`` is how a plan launches: Triton's ``kernel[grid](...)`` binds, specializes and hashes
every argument on every call (tens of microseconds of host time, more than a one-request kernel
runs); a plan's launches repeat one grid and one set of constexprs, so after the first call a
``Launcher`` hands the arguments straight to the compiled kernel's launcher, as long as they
specialize as the first call's did (dtype and 16-byte alignment of each tensor, 1 / multiple of 16 /
width of each integer); otherwise it goes through Triton again, which compiles what is new.

    k = Launcher(kernel, grid, BLOCK=64, num_warps=4)   # constexprs and options, fixed by the plan
    k(x, y, n)                                          # the runtime arguments, in the kernel's order
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

from .mla_decode import D_CKV
from .mla_merge import PART_DTYPES, _mla_merge_kernel


@dataclass
class SplitKV:
    """Stage-1 scratch and the merge of one batch's split-KV decode.

    part_o:   [B, H, S, 512] float32 (or bfloat16) partial outputs (S > 1), None when stage 1 writes
              the output
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
    _merge: "Launcher | None" = None

    @classmethod
    def make(cls, batch: int, heads: int, num_splits: int, out_dtype: torch.dtype, device,
             part_dtype: torch.dtype = torch.float32) -> "SplitKV":
        if num_splits < 1:
            raise ValueError(f"num_splits={num_splits}: must be >= 1")
        if part_dtype not in PART_DTYPES:
            raise ValueError(f"part_dtype={part_dtype}; allowed {[str(d) for d in PART_DTYPES]}")
        device = torch.device(device)
        lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
        if num_splits == 1:
            return cls(batch, heads, 1, out_dtype, device, None, lse, lse, (), {})
        part_o = torch.empty(batch, heads, num_splits, D_CKV, dtype=part_dtype, device=device)
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
        self.merge(self.part_o, self.part_lse, out, self.lse, self.heads, out.stride(0), out.stride(1),
                   float(out_scale), self.num_splits)
        return out

    @property
    def merge(self) -> "Launcher":
        if self._merge is None:
            self._merge = Launcher(_mla_merge_kernel, self.merge_grid, **self.merge_meta)
        return self._merge


class Launcher:
    """One kernel on one grid with fixed constexprs and options; called with the runtime arguments
    (positional, in the kernel's order). The first call, and any whose arguments specialize
    differently from it, goes through Triton's JIT; the others call the compiled kernel's launcher
    directly on the current stream. In Triton's interpreter (CPU) every call goes through the JIT."""

    direct_total = 0  # direct launches so far, all launchers (the GPU tests check the path is taken)

    def __init__(self, fn, grid: tuple, **meta):
        self.fn, self.meta = fn, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        params = getattr(fn, "params", None)  # None: Triton's interpreter (every call through it)
        n = sum(not p.is_constexpr for p in params) if params is not None else -1
        tail = params[n:] if params is not None else ()
        # a direct call passes every parameter in order: the runtime ones, then the constexprs
        self.direct_ok = params is not None and all(p.is_constexpr and (p.name in meta or p.has_default) for p in tail)
        self.n_runtime = n
        self.consts = tuple(meta[p.name] if p.name in meta else p.default for p in tail) if self.direct_ok else ()
        self.compiled, self.first, self.spec = None, (), ()

    def __call__(self, *args) -> None:
        ck = self.compiled
        if ck is not None and _no_hooks() and self._specializes_alike(args):
            g = self.grid
            stream = driver.active.get_current_stream(driver.active.get_current_device())
            ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata, None, None, None, *args, *self.consts)
            Launcher.direct_total += 1
            return
        if self.n_runtime >= 0 and len(args) != self.n_runtime:
            raise TypeError(f"{getattr(self.fn, '__name__', 'kernel')}: {len(args)} runtime arguments, the kernel takes {self.n_runtime}")
        ck = self.fn[self.grid](*args, **self.meta)
        if self.direct_ok and hasattr(ck, "packed_metadata"):  # a compiled kernel, not the interpreter
            self.compiled, self.first, self.spec = ck, args, tuple(map(_spec1, args))

    def _specializes_alike(self, args) -> bool:
        """Every argument specializes as the first call's did. An argument that is the first call's
        object (a plan's own buffers, layer 0's views, small ints) is not looked at again: a plan's
        launch then costs the checks of what changed (the caller's query, the new output)."""
        first, spec = self.first, self.spec
        if len(args) != len(first):
            return False
        for i, a in enumerate(args):
            if a is not first[i] and _spec1(a) != spec[i]:
                return False
        return True


def _no_hooks() -> bool:
    """No launch hook is set (a profiler such as proton sets one; the direct launch would skip it).
    Triton 3.6+ keeps the hooks as chains (empty when unset), older versions as None."""
    h = knobs.runtime.launch_enter_hook
    return h is None or not getattr(h, "calls", True)


def _spec1(a):
    """What Triton specializes a launch on, for one runtime argument (a superset: equal keys launch
    alike): a tensor's dtype and 16-byte alignment; an int's being 1, a multiple of 16, 32-bit."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if type(a) is int:
        return a == 1, a & 15 == 0, -2**31 <= a < 2**31
    return type(a)


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
