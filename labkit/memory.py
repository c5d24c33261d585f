"""Extra device memory a decode path needs beyond the pool: measured, and predicted from shapes.

Measured (``extra_memory``), the peak of bytes allocated during the call above what was
allocated before it (the returned output counts, it is alive at the end):
- CUDA: ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated`` minus the baseline
  ``memory_allocated`` (the caching allocator's own rounding to 512 B blocks included).
- CPU: a ``TorchDispatchMode`` sees every aten op; each output whose storage is new (not one of
  the op's inputs' storages) is recorded with its ``nbytes`` and a weak reference; after every op
  the live recorded bytes are summed and the peak kept. Exact storage bytes, no allocator rounding.

Predicted (``predicted_extra_bytes``), what a fused implementation must allocate:
    full_pool_cast  P*1152                 a BF16 copy of the whole layer (none for a BF16 pool)
    gather_cast     L*1152                 a BF16 copy of the rows read (L in whole pages; for a
                                           sparse batch B*topk rows: the copy has a fixed shape)
    fp8_native      B*H*splits*(512*w+4)   split-KV partial outputs (w = 4 bytes fp32, 2 for the Gluon
                                           kernels' fast bf16 partials) and their fp32 LSEs
    bf16_pool       0
plus the output B*H*512*2 for every path. The copies are BF16 whatever the stored row (576 B
fp8_per_tensor, 656 B fp8_ds_mla): ``kv_layout`` only tells whether there is anything to cast.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import kvlayout
from .roofline import layout_of


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by the ops run under this mode."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage id -> (ref, nbytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {_sid(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                sid = _sid(t)
                if sid not in seen and sid not in self.live:
                    st = t.untyped_storage()
                    self.live[sid] = (StorageWeakRef(st), st.nbytes())
        self._sweep()
        return out

    def _sweep(self) -> None:
        for sid in [s for s, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[sid]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))


def _sid(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def extra_memory(fn, device) -> int:
    """Peak bytes allocated while ``fn()`` runs beyond what existed before (see module docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del out
        return peak - base
    mode = _LiveBytes()
    with mode:
        out = fn()
    mode._sweep()
    del out
    return mode.peak


def predicted_extra_bytes(path: str, pool_tokens: int, tokens_read: int, batch: int, heads: int,
                          kv_dtype: str = "fp8_e4m3", num_splits: int = 1, d_ckv: int = 512,
                          d_kpe: int = 64, kv_layout: str | None = None, part_bytes: int = 4) -> int:
    """Bytes a fused ``path`` must allocate for one layer (see module docstring); ``kv_layout``
    (labkit.kvlayout name) overrides what ``kv_dtype`` means; ``part_bytes``: 4 (fp32 partials) or 2 (bf16)."""
    layout = kvlayout.check_layout(layout_of(kv_dtype, kv_layout))
    bf16_row = (d_ckv + d_kpe) * 2
    out = batch * heads * d_ckv * 2
    if path == "full_pool_cast":
        return (0 if layout == "bf16" else pool_tokens * bf16_row) + out
    if path == "gather_cast":
        return tokens_read * bf16_row + out
    if path == "fp8_native":
        if part_bytes not in (2, 4):
            raise ValueError(f"part_bytes={part_bytes}; allowed 2 (bf16 partials), 4 (fp32)")
        return batch * heads * num_splits * (d_ckv * part_bytes + 4) + out
    if path == "bf16_pool":
        return out
    raise ValueError(f"path={path!r}; allowed: full_pool_cast, gather_cast, fp8_native, bf16_pool")


def check(measured: int, predicted: int, rtol: float = 0.05, slack_bytes: int = 0) -> dict:
    """Compare: ``ok`` when predicted <= measured <= predicted * (1 + rtol) + slack_bytes.

    ``slack_bytes`` is what an implementation may add on top of the fused minimum (temporaries
    of the torch paths, allocator rounding); ``excess`` is measured - predicted in bytes.
    """
    ok = predicted <= measured <= predicted * (1 + rtol) + slack_bytes
    return dict(measured=int(measured), predicted=int(predicted), excess=int(measured - predicted),
                ratio=measured / predicted if predicted else float("inf"), ok=bool(ok))
