"""How one token's latent row (512 ``ckv`` + 64 ``kpe`` values) is stored: the three KV layouts.

    layout           bytes/token  row                                          scale
    bf16             1152         576 bf16                                     none
    fp8_per_tensor    576         576 e4m3                                     one fp32 per layer (k_scale)
    fp8_ds_mla        656         512 e4m3 | 4 fp32 | 64 bf16 (FlashMLA's)     one per 128 NoPE values

``fp8_ds_mla`` is the format FlashMLA and SGLang use for FP8 DSA: each 128-value group of the NoPE
part has its own scale, ``2^ceil(log2(amax / 448))`` (a power of two: dequantizing is exact in any
float format), stored as fp32 beside the values; real = stored e4m3 * scale. RoPE stays in BF16.
A packed row is ``uint8 [656]``; the views below reinterpret its bytes without copying.
"""
from __future__ import annotations

import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
D_NOPE, D_ROPE, GROUP = 512, 64, 128
N_GROUPS = D_NOPE // GROUP  # 4
KV_LAYOUTS = {"bf16": 1152, "fp8_per_tensor": 576, "fp8_ds_mla": 656}  # bytes per token
FP8_LAYOUTS = ("fp8_per_tensor", "fp8_ds_mla")
_SCALE_AT, _ROPE_AT = D_NOPE, D_NOPE + 4 * N_GROUPS  # byte offsets in a packed ds_mla row


def check_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r}; allowed: {list(KV_LAYOUTS)}")
    return kv_layout


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """x [..., 576] real -> (x_fp8 [..., 576] e4m3, k_scale) with x ~= x_fp8 * k_scale."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    k_scale = float(amax) / E4M3_MAX
    return (x.float() / k_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), k_scale


def group_scales(nope: torch.Tensor) -> torch.Tensor:
    """nope [..., 512] real -> [..., 4] fp32 power-of-two scales, 2^ceil(log2(amax / 448))."""
    amax = nope.float().abs().unflatten(-1, (N_GROUPS, GROUP)).amax(-1).clamp_min(1e-30)
    return torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))


def quantize_ds_mla(x: torch.Tensor) -> torch.Tensor:
    """x [..., 576] real -> packed uint8 [..., 656]: e4m3 NoPE, 4 fp32 group scales, bf16 RoPE."""
    if x.shape[-1] != D_NOPE + D_ROPE:
        raise ValueError(f"quantize_ds_mla: last dim {x.shape[-1]}; expected {D_NOPE + D_ROPE}")
    nope, rope = x[..., :D_NOPE].float(), x[..., D_NOPE:]
    scales = group_scales(nope)  # [..., 4]
    q = (nope.unflatten(-1, (N_GROUPS, GROUP)) / scales[..., None]).flatten(-2)
    q = q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(*x.shape[:-1], KV_LAYOUTS["fp8_ds_mla"], dtype=torch.uint8, device=x.device)
    out[..., :_SCALE_AT] = q.view(torch.uint8)
    out[..., _SCALE_AT:_ROPE_AT] = scales.contiguous().view(torch.uint8)
    out[..., _ROPE_AT:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def ds_nope(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., 656] -> [..., 512] e4m3 (a view)."""
    return packed[..., :_SCALE_AT].view(torch.float8_e4m3fn)


def ds_scales(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., 656] -> [..., 4] fp32 (copied when the rows are not 4-byte aligned views)."""
    return packed[..., _SCALE_AT:_ROPE_AT].contiguous().view(torch.float32)


def ds_rope(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., 656] -> [..., 64] bf16."""
    return packed[..., _ROPE_AT:].contiguous().view(torch.bfloat16)


def dequant_ds_mla(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """packed uint8 [..., 656] -> real values [..., 576] in ``dtype``."""
    nope = ds_nope(packed).float().unflatten(-1, (N_GROUPS, GROUP)) * ds_scales(packed)[..., None]
    return torch.cat([nope.flatten(-2), ds_rope(packed).float()], -1).to(dtype)


def quantize(x: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, float]:
    """x [..., 576] real -> (stored row, k_scale): k_scale is 1.0 where the row carries its scales."""
    check_layout(kv_layout)
    if kv_layout == "fp8_per_tensor":
        return quantize_e4m3(x)
    if kv_layout == "fp8_ds_mla":
        return quantize_ds_mla(x), 1.0
    return x.to(torch.bfloat16), 1.0


def dequant(stored: torch.Tensor, kv_layout: str, k_scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """A stored row tensor [..., bytes or 576] -> real values [..., 576] in ``dtype``."""
    check_layout(kv_layout)
    if kv_layout == "fp8_ds_mla":
        return dequant_ds_mla(stored, dtype)
    return stored.to(dtype) * k_scale
