"""``fp8_ds_mla`` rows (656 B) -> BF16 rows (576 values), dequantized with their group scales.

A packed row: 512 e4m3 NoPE | 4 fp32 scales (one per 128 NoPE values, powers of two) | 64 bf16 RoPE.
Out: NoPE = e4m3 * scale (exact in BF16: a power-of-two scale adds no mantissa bits), RoPE copied.
Two uses, one kernel:
- whole buffer (``kv_indices`` None): output row r is input row r (``full_pool_cast``);
- gather (``kv_indices`` given): output page j is input page ``kv_indices[j]`` (``gather_cast``: the
  batch's pages; with a one-token-page view ``rows[:, None]`` a sparse batch's slots). A -1 id is a
  zero page and reads nothing (a sparse batch's padding).
Bytes moved: N rows * (656 read + 1152 written); one multiply per NoPE value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla_decode_fp8_rows import DS_ROPE_AT_BF16, DS_ROW, DS_ROW_BF16, DS_ROW_F32, DS_SCALE_AT_F32, LAYOUT_ROW

ROW_BYTES, D_OUT = LAYOUT_ROW["fp8_ds_mla"], 576


@triton.jit
def _ds_mla_to_bf16_kernel(
    nope_ptr,  # *fp8e4nv: the packed rows viewed as e4m3, a row every 656 elements (NoPE first)
    scale_ptr,  # *f32: the same bytes as fp32, a row every 164 (its 4 scales at 128..131)
    rope_ptr,  # *bf16: the same bytes as bf16, a row every 328 (its RoPE at 264..327)
    idx_ptr,  # *i32 [nnz] page ids (GATHER only), -1 = none
    out_ptr,  # *bf16 [n_out, 576], contiguous
    n_out,  # output rows
    PAGE: tl.constexpr,  # rows per page (GATHER: output row r is row r % PAGE of page idx[r // PAGE])
    ROWS: tl.constexpr,  # output rows per program
    GATHER: tl.constexpr,
    SCALE4: tl.constexpr,  # load a row's 4 scales once and broadcast them (else one load per value)
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] output row
    ok = r < n_out
    if GATHER:
        page = tl.load(idx_ptr + r // PAGE, mask=ok, other=-1).to(tl.int64)
        ok = ok & (page >= 0)
        src = tl.maximum(page, 0) * PAGE + r % PAGE  # [ROWS] input row
    else:
        src = r
    c = tl.arange(0, 512)
    x = tl.load(nope_ptr + src[:, None] * DS_ROW + c[None, :], mask=ok[:, None], other=0.0)
    if SCALE4:
        g = tl.arange(0, 4)
        sc = tl.load(scale_ptr + src[:, None] * DS_ROW_F32 + DS_SCALE_AT_F32 + g[None, :], mask=ok[:, None],
                     other=0.0)  # [ROWS, 4]
        y = tl.reshape(tl.reshape(x.to(tl.float32), [ROWS, 4, 128]) * sc[:, :, None], [ROWS, 512])
    else:
        sc = tl.load(scale_ptr + src[:, None] * DS_ROW_F32 + DS_SCALE_AT_F32 + c[None, :] // 128, mask=ok[:, None],
                     other=0.0)
        y = x.to(tl.float32) * sc
    dst = out_ptr + r[:, None] * 576
    wmask = (r < n_out)[:, None]
    tl.store(dst + c[None, :], y.to(tl.bfloat16), mask=wmask)
    d = tl.arange(0, 64)
    pe = tl.load(rope_ptr + src[:, None] * DS_ROW_BF16 + DS_ROPE_AT_BF16 + d[None, :], mask=ok[:, None], other=0.0)
    tl.store(dst + 512 + d[None, :], pe, mask=wmask)


def ds_mla_to_bf16(packed: torch.Tensor, kv_indices: torch.Tensor | None = None, *, rows: int = 16,
                   num_warps: int = 4, scale4: bool = True) -> torch.Tensor:
    """Dequantize ``fp8_ds_mla`` rows to BF16: all of them, or the pages ``kv_indices`` names.

    Parameters
    ----------
    packed : torch.Tensor
        ``torch.uint8`` [..., 656], contiguous (e.g. one pool layer [num_pages, page_size, 656], or
        its token rows as one-token pages [pool_tokens, 1, 656]); 3-D when ``kv_indices`` is given.
    kv_indices : torch.Tensor, optional
        [nnz] ``torch.int32`` page ids into ``packed``'s first dim, -1 = none (a zero page, nothing
        read); ids are not checked on the device.
    rows, num_warps, scale4 : tuning (output rows per program, a power of two; warps per program;
        a row's 4 scales loaded once and broadcast, else one load per value). Measured on the H200
        (scripts/gpu_kernels.py, run 11g: the top-2048 rows of 64 requests, 237 MB moved): 16 rows,
        4 warps, scale4 67.6-69.4 us (80-82% of copy) against 111-112 us (50%) without scale4; 2-8
        rows and 2-4 warps within 3% of it with scale4.

    Returns
    -------
    torch.Tensor
        ``torch.bfloat16``: [..., 576] (``packed``'s leading shape) without ``kv_indices``, else
        [nnz, page_size, 576]. Moves N * (656 + 1152) B for N output rows.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.shape[-1:] != (ROW_BYTES,):
        raise ValueError(f"packed must be a torch.uint8 tensor [..., {ROW_BYTES}] (fp8_ds_mla rows), got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    if not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous (strides {tuple(packed.stride())})")
    if packed.storage_offset() % 4:
        raise ValueError("packed must start on a 4-byte boundary (its fp32 scales are read in place)")
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows={rows}: must be a power of two")
    if kv_indices is None:
        out = torch.empty(*packed.shape[:-1], D_OUT, dtype=torch.bfloat16, device=packed.device)
        idx, page, gather = packed, 1, False  # idx unused
    else:
        if packed.dim() != 3:
            raise ValueError(f"packed must be [num_pages, page_size, {ROW_BYTES}] with kv_indices, "
                             f"got {tuple(packed.shape)}")
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 1 or kv_indices.dtype != torch.int32:
            raise ValueError(f"kv_indices must be a 1-D torch.int32 tensor [nnz], got "
                             f"{getattr(kv_indices, 'dtype', type(kv_indices).__name__)} "
                             f"{tuple(getattr(kv_indices, 'shape', ()))}")
        if kv_indices.device != packed.device:
            raise ValueError(f"kv_indices is on {kv_indices.device}, packed on {packed.device}")
        page = packed.shape[1]
        out = torch.empty(kv_indices.numel(), page, D_OUT, dtype=torch.bfloat16, device=packed.device)
        idx, gather = kv_indices.contiguous(), True
    n_out = out.numel() // D_OUT
    if n_out == 0:
        return out
    _ds_mla_to_bf16_kernel[(triton.cdiv(n_out, rows),)](
        packed.view(torch.float8_e4m3fn), packed.view(torch.float32), packed.view(torch.bfloat16), idx, out,
        n_out, PAGE=page, ROWS=rows, GATHER=gather, SCALE4=scale4, num_warps=num_warps,
    )
    return out
