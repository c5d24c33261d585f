"""Where the accurate Gluon kernel's error comes from: ``labkit.mma_model.decode`` on the bench's
kind of data (a random FP8 pool, 16 heads, requests of 8K), for accumulator widths and split
lengths (tokens one CTA accumulates), against the float64 oracle; errors of the fp32 output and
of its BF16 rounding (what the bench compares). Runs on a CPU (float64 torch), about a minute.

    python3 scripts/fp8_accumulation.py --out DIR [--heads 16 --batch 2 --len 8192]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from labkit import envinfo, kvpool, mma_model, reference  # noqa: E402

BITS = (None, 16, 14, 13, 12)
CHAINS = (256, 2048, 4096, 8192)


def case(batch: int, heads: int, length: int):
    pool = kvpool.random_pool(1, batch * length + 64, 64, seed=1)
    b = kvpool.batch_for_pool(pool, [length] * batch, seed=2)
    qn, qp = kvpool.make_queries(batch, heads, seed=3)
    real = pool.dequant(0, torch.float64)
    kv = torch.stack([real[b.kv_indices[b.kv_indptr[i]:b.kv_indptr[i + 1]].long()].reshape(-1, 576)[:length]
                      for i in range(batch)])
    return torch.cat([qn, qp], -1).double(), kv, reference.mla_decode(qn, qp, real, b, 1 / 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--len", type=int, default=8192)
    a = ap.parse_args()
    q, kv, ref = case(a.batch, a.heads, a.len)
    rows = []
    print(f"{'bits':>5} {'split':>6} {'err fp32':>9} {'err bf16':>9} {'promoted fp32':>14} {'promoted bf16':>14}")
    for bits in BITS:
        for chain in (c for c in CHAINS if c <= a.len):
            out = mma_model.decode(q, kv, chain, bits)
            row = dict(bits=bits, split_len=chain, err=reference.rel_err(out, ref),
                       err_bf16=reference.rel_err(out.to(torch.bfloat16), ref))
            if bits is not None:
                p = mma_model.decode(q, kv, chain, bits, promote=True)
                row.update(err_promoted=reference.rel_err(p, ref), err_promoted_bf16=reference.rel_err(p.to(torch.bfloat16), ref))
            rows.append(row)
            f = lambda k: f"{row[k]:.2e}" if k in row else "-"  # noqa: E731
            print(f"{str(bits):>5} {chain:>6} {f('err'):>9} {f('err_bf16'):>9} {f('err_promoted'):>14} "
                  f"{f('err_promoted_bf16'):>14}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_accumulation.json").write_text(json.dumps(
        dict(command=" ".join(sys.argv), env=envinfo.env_info("cpu"), heads=a.heads, batch=a.batch, len=a.len,
             rows=rows), indent=1))
    print(f"-> {out / 'fp8_accumulation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
