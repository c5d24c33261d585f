"""The DSA indexer's logits at a few sampled positions per request, and from them the threshold of
the top-k's candidates, in one Triton launch (``labkit.indexer.logits_with_candidates``' first step).

Program (t, b) scores BLOCK_T of request b's sampled tokens (``labkit.indexer.SampleTable``: S =
min(kv_lens[b], SAMPLE) global token ids a request, in any order) as ``index_logits`` does; the
last of a request's programs to arrive (one atomic add each on the request's arrival count) reads
the S logits back from L2 and writes the threshold t16[b] (``topk_prefilter._sampled_threshold``:
65536 where n <= topk, 0 where the sample's rank would pass its end) and zeroes count[b] for the
logits kernel's candidates; then it resets the arrival count, so the counts stay zero between calls
and a captured graph needs no memset. Where the sampled logits and the threshold were two launches
(8.4 and 5.2 us at 64 x 32K on an H100, run 20), the threshold now costs one program a request,
under the other requests' tiles.

Bytes per request: S rows of D + 4 (scattered unless the sample comes in runs), 4 S of logits
written and read back once, 4 B of ids per sampled token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .index_logits import _tile_logits, pad_heads
from .topk_prefilter import _sampled_threshold
from .topk_select import _barriers


@triton.jit
def _index_sample_kernel(q_ptr, w_ptr, k_ptr, s_ptr, ids_ptr, lens_ptr, out_ptr, t16_ptr, count_ptr, arrivals_ptr,
                         topk, stride_kp, stride_sp, IPAGE: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, SAMPLE: tl.constexpr):
    pid_t, b = tl.program_id(0), tl.program_id(1)
    n = tl.load(lens_ptr + b)
    S = tl.minimum(n, SAMPLE)
    pos = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row = out_ptr + b.to(tl.int64) * SAMPLE
    logit = tl.full([BLOCK_T], float("-inf"), tl.float32)
    if pid_t * BLOCK_T < S:  # else a tile wholly past the sample: -inf
        d, h = tl.arange(0, D), tl.arange(0, H_PAD)
        q_t = tl.load(q_ptr + b * H_PAD * D + h[None, :] * D + d[:, None])  # [D, H_PAD] fp8
        w = tl.load(w_ptr + b * H_PAD + h)
        tok = tl.load(ids_ptr + b.to(tl.int64) * SAMPLE + tl.minimum(pos, S - 1)).to(tl.int64)
        logit = tl.where(pos < S, _tile_logits(k_ptr, s_ptr, tok, q_t, w, stride_kp, stride_sp, IPAGE, D),
                         float("-inf"))
    tl.store(row + pos, logit)
    tl.debug_barrier()  # every thread's stores before the arrival (released by it)
    if tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(t16_ptr + b, _sampled_threshold(row, n, topk, SAMPLE, True))
        tl.store(count_ptr + b, 0)
        tl.atomic_xchg(arrivals_ptr + b, 0)  # every program of the request has arrived: ready for the next call


def index_sample_threshold(q_idx, weights, k_idx, k_scale, sample_ids, kv_lens, sample: int, topk: int,
                           block_t: int = 64, num_warps: int = 4):
    """Sampled logits and the candidates' thresholds (module docstring), one launch.

    q_idx [B, H, D] float8_e4m3fn and weights [B, H] float32 (heads padded to a power of two >= 16
        by ``index_logits.pad_heads``: two launches, none at GLM-5's 32); k_idx [pages, 64, D]
        float8_e4m3fn and k_scale [pages, 64] float32 (rows contiguous, any page stride), as
        ``index_logits`` takes them.
    sample_ids : [B * sample] int32 global token ids, request b's first min(kv_lens[b], sample) at
        b * sample (``labkit.indexer.SampleTable.kv_indices``); kv_lens [B] int32 context lengths;
        sample : a power of two 16..8192; topk >= 1.
    Returns (sampled [B, sample] float32 logits, -inf past S; t16 [B] int32; count [B] int32 zeros).
    """
    B, _, D = q_idx.shape
    if sample < 16 or sample & (sample - 1) or sample > 8192 or sample_ids.numel() != B * sample:
        raise ValueError(f"sample={sample}: a power of two in 16..8192 with sample_ids of B * sample = "
                         f"{B * sample} entries, got {sample_ids.numel()}")
    dev = q_idx.device
    out = torch.empty(B, sample, dtype=torch.float32, device=dev)
    t16 = torch.empty(B, dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        block_t = min(block_t, sample)
        q, w = pad_heads(q_idx, weights)
        _index_sample_kernel[(sample // block_t, B)](
            q, w, k_idx, k_scale, sample_ids, kv_lens, out, t16, count, _barriers(dev, B), topk, k_idx.stride(0),
            k_scale.stride(0), IPAGE=k_idx.shape[1], D=D, H_PAD=q.shape[1], BLOCK_T=block_t, SAMPLE=sample,
            num_warps=num_warps)
    return out, t16, count
