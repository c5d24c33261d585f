"""Triton (and one Gluon) kernels of the lab, one per file; imported as ``labkit.kernels``.

    labkit.kernels.fp8_to_bf16.fp8_to_bf16(x)                   whole-buffer FP8 -> BF16 cast
    labkit.kernels.gather_cast.gather_cast(kv_buffer, kv_indices)  the batch's pages, widened
    labkit.kernels.ds_mla_to_bf16.ds_mla_to_bf16(packed, kv_indices=None)  656-byte ds_mla rows -> BF16
    labkit.kernels.mla_decode.mla_decode(q_nope, q_pe, kv_buffer, ...)  MLA decode, 16-bit KV
    labkit.kernels.mla_decode_fp8.mla_decode_fp8(...)           the same over FP8 KV
    labkit.kernels.mla_decode_fp8_gluon.mla_decode_fp8_gluon(...)  Gluon, Hopper: FP8 wgmma for both products
    labkit.kernels.mla_merge.mla_merge(part_out, part_lse, ...)  split-KV merge (both decodes)
    labkit.kernels.topk_select.topk_select(logits, kv_lens, ...)  DSA indexer top-k -> token slots

The launchers are not re-exported here: their names equal their modules' and would shadow them.
"""
