"""Top-k token selection for the DSA indexer in CUDA C (compiled at run time by NVRTC): the contract
of ``labkit.kernels.topk_select`` (same arguments, same slots), one block of ``threads`` a request.

Why CUDA. Every Triton top-k measured (runs 10-24, nine designs) spent its time in block-level
primitives: ``tl.histogram`` is a ballot per digit bit and a popc per bin a lane owns, and each
round ends at a barrier. Here a key costs one shared-memory atomic (or one ``match.any`` and one
atomic a warp's equal digits, ``agg``), and the writes of slots and candidates are aggregated a
warp at a time (one ballot, one atomic, a popc per lane).

Method, per request of n > topk positions (keys: the float32 logits as uint32 whose order is the
float order, NaN as -inf, -0.0 as +0.0):
1. one pass reads the row (float4 loads where it is 16-byte aligned), keeps its keys in shared
   memory (when the batch's longest row fits, ``layout``; otherwise every later pass reads the
   row again, mostly from L2) and takes their max and min: the bits above the highest bit where
   these differ are common to the row, so every digit starts below them;
2. the sampled threshold (rows of at least 4 topk and 2 ``sample`` keys): two radix rounds over
   ``sample`` evenly spaced keys give a key T that about topk * (1 + margin) keys of the row reach
   (margin: 3 sqrt of the expected rank in the sample, + 16); a count pass, a block scan and a
   write pass keep the keys >= T as candidates (no atomics); if there are at least topk of them
   and at most ``cap``, radix rounds over the candidates select the top-k, and the row is done;
3. otherwise (or with ``sample=0``), rounds of ``digit_bits``-bit digits over the whole row: a
   shared-memory histogram (one atomic a key, or with ``agg`` one ``match.any`` and one atomic a
   warp's equal digits) and a block scan for the k-th key's bin, until that bin holds at most
   ``cap`` keys, or exactly the keys still missing, or every bit is fixed; a pass writes the keys
   above it and keeps those in it as candidates, whose rounds fix the remaining bits;
4. a last pass writes the candidates above the k-th key, then as many equal to it as are missing
   (ties in no set order); slots are written warp-aggregated (a ballot, one atomic a warp).
One digit over the whole row costs the most when the logits take both signs (the usual case): max
and min then part at the sign bit, the first digit is sign, exponent and two mantissa bits, and
most keys fall into a few bins whose atomics serialize (runs 25a-b).

Slots as ``topk_select``: int32 [B, topk], global token ids (position p of request b is token
kv_indices[kv_indptr[b] + p // page_size] * page_size + p % page_size); a request with kv_lens[b]
<= topk gets all its tokens in context order, then -1; a longer one exactly topk distinct tokens,
in no set order.

Bytes per request of n > topk: 4 n read once (rows kept in shared memory) or three times and more
(rows that do not fit), 4 B per slot written and 4 B of page table read per slot. Shared memory:
4 * (2^digit_bits + 2 * cap + cache_cap) bytes a block (``layout``).
"""
from __future__ import annotations

import torch

from .topk_select import check_args

MIN_CAP, MAX_CAP = 4096, 16384  # candidates kept in shared memory (key + position): the least, the most
_DEFINES = ("THREADS", "DB", "AGG", "UNROLL", "SAMPLE")

_SRC = r"""
#define FULL 0xffffffffu
#define NB (1 << DB)
#define NW (THREADS / 32)
#define BPT (NB >= THREADS ? NB / THREADS : 1)

__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// the bits above bit hi (hi = -1: all of them), which a prefix of the keys fixes
__device__ __forceinline__ unsigned mask_above(int hi) { return hi >= 31 ? 0u : ~((1u << (hi + 1)) - 1u); }

// position p of a request -> its global token slot, through the request's page ids
__device__ __forceinline__ int slot_of(const int* pages, int page_size, int p) {
  return pages[p / page_size] * page_size + p % page_size;
}

// float32 -> uint32 whose unsigned order is the float order; NaN counts as -inf, -0.0 as +0.0
__device__ __forceinline__ unsigned ukey(float x) {
  if (!(x == x)) x = __int_as_float(0xff800000);
  if (x == 0.0f) x = 0.0f;
  unsigned b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Shared {
  int above, ties, ncand;       // slots written above the fixed bits; ties written; candidates kept
  unsigned kmax, kmin;
  int d, dabove, dcnt;          // the chosen bin, keys in larger bins, keys in it
  int wsum[NW];
};

struct RowSrc {  // a row read from global memory
  const float* row;
  __device__ __forceinline__ unsigned key(int i) const { return ukey(__ldg(row + i)); }
  __device__ __forceinline__ int pos(int i) const { return i; }
};
struct KeySrc {  // keys in shared memory, with their positions (candidates) or not (a cached row)
  const unsigned* k; const int* p;
  __device__ __forceinline__ unsigned key(int i) const { return k[i]; }
  __device__ __forceinline__ int pos(int i) const { return p ? p[i] : i; }
};

// exclusive prefix sum over the block's threads (in thread order)
__device__ int block_excl_scan(int v, int* wsum) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(FULL, x, o); if (lane >= o) x += y; }
  if (lane == 31) wsum[w] = x;
  __syncthreads();
  if (w == 0) {
    int s = lane < NW ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(FULL, s, o); if (lane >= o) s += y; }
    __syncwarp();
    if (lane < NW) wsum[lane] = s;
  }
  __syncthreads();
  int r = (w ? wsum[w - 1] : 0) + x - v;
  __syncthreads();
  return r;
}

// one index per lane with p set, from a counter shared by the block: one atomic a warp
__device__ __forceinline__ int agg_index(bool p, int* counter) {
  unsigned m = __ballot_sync(FULL, p);
  if (m == 0u) return -1;
  const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(counter, __popc(m));
  base = __shfl_sync(FULL, base, leader);
  return p ? base + __popc(m & ((1u << lane) - 1u)) : -1;
}

// histogram of digit (key >> lo) & dmask over the n keys whose fixed bits (pmask) equal pre
template <class Src>
__device__ void histogram(const Src& src, int n, unsigned pre, unsigned pmask, int lo, unsigned dmask, int* hist) {
  for (int i = threadIdx.x; i < NB; i += THREADS) hist[i] = 0;
  __syncthreads();
  for (int i0 = 0; i0 < n; i0 += THREADS * UNROLL) {
    unsigned k[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { int i = i0 + u * THREADS + threadIdx.x; k[u] = i < n ? src.key(i) : 0u; }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int i = i0 + u * THREADS + threadIdx.x;
      bool ok = i < n && (k[u] & pmask) == pre;
      unsigned dig = (k[u] >> lo) & dmask;
#if AGG
      unsigned peers = __match_any_sync(FULL, ok ? dig : 0xffffffffu);
      if (ok && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + dig, __popc(peers));
#else
      if (ok) atomicAdd(hist + dig, 1);
#endif
    }
  }
  __syncthreads();
}

// the bin holding the need-th largest key: s.d, s.dabove (keys in larger bins), s.dcnt
__device__ void select_bin(const int* hist, int need, Shared& s) {
  const int t = threadIdx.x;
  int h[BPT], sum = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) { int bin = NB - 1 - (t * BPT + j); h[j] = bin >= 0 ? hist[bin] : 0; sum += h[j]; }
  int acc = block_excl_scan(sum, s.wsum);  // keys in the bins above this thread's
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    if (acc < need && acc + h[j] >= need) { s.d = NB - 1 - (t * BPT + j); s.dabove = acc; s.dcnt = h[j]; }
    acc += h[j];
  }
  __syncthreads();
}

// keys above the fixed bits -> slots; keys equal to them -> candidates (cand) or, all bits being
// fixed, slots for the first `need` of them
template <class Src>
__device__ void emit(const Src& src, int n, unsigned pre, unsigned pmask, bool cand, int need, int topk,
                     int* out, const int* pages, int page_size, unsigned* ckey, int* cpos, Shared& s) {
  for (int i0 = 0; i0 < n; i0 += THREADS) {
    int i = i0 + threadIdx.x;
    unsigned k = i < n ? src.key(i) : 0u, m = k & pmask;
    bool gt = i < n && m > pre, eq = i < n && m == pre;
    int a = agg_index(gt, &s.above);
    if (gt) out[a] = slot_of(pages, page_size, src.pos(i));
    int e = agg_index(eq, cand ? &s.ncand : &s.ties);
    if (eq && cand) { ckey[e] = k; cpos[e] = src.pos(i); }
    if (eq && !cand && e < need) out[topk - need + e] = slot_of(pages, page_size, src.pos(i));
  }
}

// rounds over src until the bin is small enough (row) or every bit is fixed (candidates), at most
// max_rounds; true when the k-th key's bits are all known or its bin is taken whole
template <class Src>
__device__ bool rounds(const Src& src, int n, unsigned& pre, unsigned& pmask, int& hi, int& need, bool row,
                       int* hist, Shared& s, int cap, int max_rounds = 32) {
  for (int r = 0; r < max_rounds; ++r) {
    int lo = imax(0, hi + 1 - DB);
    unsigned dmask = (1u << (hi - lo + 1)) - 1u;
    histogram(src, n, pre, pmask, lo, dmask, hist);
    select_bin(hist, need, s);
    need -= s.dabove;
    int cnt = s.dcnt;
    pre |= (unsigned)s.d << lo;
    pmask |= dmask << lo;
    hi = lo - 1;
    if (lo == 0 || cnt == need) return true;
    if (row && cnt <= cap) return false;         // few enough to keep as candidates
  }
  return false;
}

template <class Src>
struct Strided {  // every stride-th key of src
  Src src; int stride;
  __device__ __forceinline__ unsigned key(int i) const { return src.key(i * stride); }
  __device__ __forceinline__ int pos(int i) const { return src.pos(i * stride); }
};

// The sampled threshold: a key T that about topk * (1 + margin) keys of the row reach, from the
// rank of SAMPLE evenly spaced keys (two rounds); the keys >= T become the candidates, and if they
// are at least topk and at most cap, the top-k is selected among them. Otherwise (the sample
// misjudged the row) false, nothing written, and the full rounds run. The candidates are written
// in two passes, a count per thread and then the keys at the thread's offset from a block scan:
// no atomics, and their order follows the row.
template <class Src>
__device__ bool sampled(const Src& src, int n, int topk, int cap, int* out, const int* pages, int page_size,
                        int* hist, unsigned* ckey, int* cpos, Shared& s) {
  const int r = (int)(((long long)topk * SAMPLE + n - 1) / n);
  int need = r + 3 * (int)__fsqrt_rn((float)r) + 16;
  need = need < SAMPLE ? need : SAMPLE;
  int hi = 31 - __clz(s.kmax ^ s.kmin);
  unsigned pmask = mask_above(hi), pre = s.kmax & pmask;
  const Strided<Src> smp{src, n / (SAMPLE ? SAMPLE : 1)};
  rounds(smp, SAMPLE, pre, pmask, hi, need, false, hist, s, 0, 2);
  const unsigned T = pre;
  int c = 0;
  for (int i0 = 0; i0 < n; i0 += THREADS * UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { int i = i0 + u * THREADS + threadIdx.x; c += i < n && src.key(i) >= T; }
  }
  int off = block_excl_scan(c, s.wsum);
  if (threadIdx.x == THREADS - 1) s.ncand = off + c;
  __syncthreads();
  const int nc = s.ncand;
  __syncthreads();
  if (nc < topk || nc > cap) {
    if (threadIdx.x == 0) s.ncand = 0;
    __syncthreads();
    return false;
  }
  for (int i0 = 0; i0 < n; i0 += THREADS * UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int i = i0 + u * THREADS + threadIdx.x;
      unsigned k = i < n ? src.key(i) : 0u;
      if (i < n && k >= T) { ckey[off] = k; cpos[off] = src.pos(i); ++off; }
    }
  }
  __syncthreads();
  const unsigned x = s.kmax ^ T;  // every candidate lies in [T, kmax]
  hi = x ? 31 - __clz(x) : -1;
  pmask = mask_above(hi);
  pre = s.kmax & pmask;
  need = topk;
  const KeySrc cand{ckey, cpos};
  if (hi >= 0) rounds(cand, nc, pre, pmask, hi, need, false, hist, s, 0);
  emit(cand, nc, pre, pmask, false, need, topk, out, pages, page_size, ckey, cpos, s);
  return true;
}

extern "C" __global__ void __launch_bounds__(THREADS) topk_radix_cuda(
    const float* __restrict__ logits, int row_stride, const int* __restrict__ kv_lens,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, int page_size, int topk,
    int* __restrict__ slots, int cache_cap, int cap, int vec) {
  extern __shared__ int dyn[];
  __shared__ Shared s;
  int* hist = dyn;
  unsigned* ckey = (unsigned*)(dyn + NB);
  int* cpos = dyn + NB + cap;
  unsigned* keys = (unsigned*)(dyn + NB + 2 * cap);
  const int b = blockIdx.x, n = kv_lens[b];
  int* out = slots + (long long)b * topk;
  const int* pages = kv_indices + kv_indptr[b];
  if (n <= topk) {
    for (int i = threadIdx.x; i < topk; i += THREADS) out[i] = i < n ? slot_of(pages, page_size, i) : -1;
    return;
  }
  if (threadIdx.x == 0) { s.above = 0; s.ties = 0; s.ncand = 0; s.kmax = 0u; s.kmin = 0xffffffffu; }
  const RowSrc grow{logits + (long long)b * row_stride};
  const bool cached = n <= cache_cap;
  unsigned kmax = 0u, kmin = 0xffffffffu;
  auto keep = [&](int i, unsigned k) {
    if (cached) keys[i] = k;
    kmax = k > kmax ? k : kmax;
    kmin = k < kmin ? k : kmin;
  };
  const int n4 = vec ? n / 4 : 0;  // float4 loads where the row is 16-byte aligned: 4x the bytes in flight
  const float4* row4 = reinterpret_cast<const float4*>(grow.row);
  for (int j0 = 0; j0 < n4; j0 += THREADS * UNROLL) {
    float4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int j = j0 + u * THREADS + threadIdx.x;
      if (j < n4) v[u] = __ldg(row4 + j);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int j = j0 + u * THREADS + threadIdx.x;
      if (j < n4) { keep(4 * j, ukey(v[u].x)); keep(4 * j + 1, ukey(v[u].y)); keep(4 * j + 2, ukey(v[u].z)); keep(4 * j + 3, ukey(v[u].w)); }
    }
  }
  for (int i0 = 4 * n4; i0 < n; i0 += THREADS * UNROLL) {
    unsigned k[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { int i = i0 + u * THREADS + threadIdx.x; k[u] = i < n ? grow.key(i) : 0u; }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { int i = i0 + u * THREADS + threadIdx.x; if (i < n) keep(i, k[u]); }
  }
  kmax = __reduce_max_sync(FULL, kmax);
  kmin = __reduce_min_sync(FULL, kmin);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { atomicMax(&s.kmax, kmax); atomicMin(&s.kmin, kmin); }
  __syncthreads();
  const unsigned x = s.kmax ^ s.kmin;
  int need = topk, hi = x ? 31 - __clz(x) : -1;
  unsigned pmask = mask_above(hi), pre = s.kmax & pmask;  // hi == -1: every bit fixed
  const KeySrc crow{keys, nullptr};
  if (SAMPLE && x && n >= 4 * topk && n >= 2 * SAMPLE && cap >= topk &&
      (cached ? sampled(crow, n, topk, cap, out, pages, page_size, hist, ckey, cpos, s)
              : sampled(grow, n, topk, cap, out, pages, page_size, hist, ckey, cpos, s)))
    return;
  bool done = hi < 0 || (cached ? rounds(crow, n, pre, pmask, hi, need, true, hist, s, cap)
                                : rounds(grow, n, pre, pmask, hi, need, true, hist, s, cap));
  if (cached) emit(crow, n, pre, pmask, !done, need, topk, out, pages, page_size, ckey, cpos, s);
  else emit(grow, n, pre, pmask, !done, need, topk, out, pages, page_size, ckey, cpos, s);
  if (done) return;
  __syncthreads();
  const KeySrc cand{ckey, cpos};
  const int nc = s.ncand;
  rounds(cand, nc, pre, pmask, hi, need, false, hist, s, cap);
  emit(cand, nc, pre, pmask, false, need, topk, out, pages, page_size, ckey, cpos, s);
}
"""

_KERNELS: dict = {}
_AVAILABLE: dict = {}  # device index -> whether the default kernel compiled


def source(threads: int = 1024, digit_bits: int = 11, agg: bool = False, unroll: int = 4, sample: int = 4096) -> str:
    """The CUDA C source with its compile-time constants defined (``nvcc -cubin`` takes it too)."""
    vals = dict(THREADS=threads, DB=digit_bits, AGG=int(agg), UNROLL=unroll, SAMPLE=sample)
    return "".join(f"#define {k} {vals[k]}\n" for k in _DEFINES) + _SRC


def _compiled(device: torch.device, threads: int, digit_bits: int, agg: bool, unroll: int, sample: int):
    key = (device.index, threads, digit_bits, agg, unroll, sample)
    if key not in _KERNELS:
        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None:
            raise RuntimeError(f"topk_cuda needs torch.cuda._compile_kernel (NVRTC), absent in torch {torch.__version__}")
        with torch.cuda.device(device):
            _KERNELS[key] = compile_kernel(source(threads, digit_bits, agg, unroll, sample), "topk_radix_cuda")
    return _KERNELS[key]


def available(device) -> bool:
    """Whether the default kernel compiles on ``device`` (a CUDA device with NVRTC); tried once."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.index not in _AVAILABLE:
        try:
            k = topk_cuda.__kwdefaults__  # the launcher's defaults, not a second copy of them
            _compiled(device, k["threads"], k["digit_bits"], k["agg"], k["unroll"], k["sample"])
            _AVAILABLE[device.index] = True
        except Exception:  # noqa: BLE001 - no NVRTC, an older torch: the Triton top-k serves instead
            _AVAILABLE[device.index] = False
    return _AVAILABLE[device.index]


def _smem_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def max_cache(device: torch.device, digit_bits: int = 11) -> int:
    """The longest row whose keys the block keeps in shared memory (a multiple of 1024), leaving
    room for MIN_CAP candidates."""
    free = _smem_limit(device) - 4 * ((1 << digit_bits) + 2 * MIN_CAP) - 1024  # 1 KiB for the static part
    return max(0, free // 4096 * 1024)


def layout(device: torch.device, max_len: int, digit_bits: int = 11, cache: bool = True) -> tuple[int, int, int]:
    """(cache_cap, cap, bytes): rows of at most cache_cap keys are kept in shared memory (all rows
    or none: a batch whose longest row does not fit reads every row from global memory), cap
    candidates fit in what is left (at most MAX_CAP), and the block's dynamic shared memory."""
    cache_cap = max_len if cache and max_len <= max_cache(device, digit_bits) else 0
    free = _smem_limit(device) - 4 * ((1 << digit_bits) + cache_cap) - 1024
    cap = min(MAX_CAP, free // 8)
    return cache_cap, cap, 4 * ((1 << digit_bits) + 2 * cap + cache_cap)


def _set_smem(kernel, device: torch.device, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory: past 48 KiB the driver's attribute must say so
    (set when the size grows); the launch wrapper checks ``_max_shared_mem_bytes``."""
    if nbytes <= getattr(kernel, "_max_shared_mem_bytes", 0):
        return
    if nbytes >= 48 * 1024:
        from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

        with torch.cuda.device(device):
            _check_cuda(_get_gpu_runtime_library().cuFuncSetAttribute(kernel.func, 8, nbytes))  # MAX_DYNAMIC_SHARED_SIZE
    kernel._max_shared_mem_bytes = nbytes


def topk_cuda(logits, kv_lens, kv_indptr, kv_indices, page_size: int, topk: int, *, threads: int = 1024,
              digit_bits: int = 11, agg: bool = False, unroll: int = 4, cache: bool = True,
              sample: int = 4096) -> torch.Tensor:
    """Global token slots of each request's ``topk`` largest logits, one CUDA block a request.

    Parameters
    ----------
    logits : [B, max_len] torch.float32 on a CUDA device, rows contiguous (any row stride);
        positions >= kv_lens[b] are never read.
    kv_lens : [B] int32; kv_indptr : [B + 1] int32; kv_indices : [nnz] int32 KV page ids.
    page_size : KV page size (>= 1); topk : slots per request (>= 1).
    threads : threads a block (128, 256, 512 or 1024); digit_bits : bits a radix round (8..12);
    agg : count a warp's equal digits with one atomic (``match.any``); unroll : keys a thread loads
    at once; cache : keep rows of at most ``max_cache`` keys in shared memory; sample : 0, or the
    keys (1024, 2048, 4096) whose rank sets a threshold that keeps the candidates (rows of at least
    4 topk and 2 sample keys).

    Returns
    -------
    slots : [B, topk] torch.int32, as ``labkit.kernels.topk_select``.
    """
    B, T = check_args(logits, kv_lens, kv_indptr, kv_indices, page_size, topk)
    if threads not in (128, 256, 512, 1024):
        raise ValueError(f"threads={threads!r}: must be 128, 256, 512 or 1024")
    if digit_bits not in (8, 9, 10, 11, 12):
        raise ValueError(f"digit_bits={digit_bits!r}: must be an integer in 8..12")
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"unroll={unroll!r}: must be 1, 2, 4 or 8")
    if sample not in (0, 1024, 2048, 4096):
        raise ValueError(f"sample={sample!r}: must be 0, 1024, 2048 or 4096")
    dev = logits.device
    if dev.type != "cuda":
        raise ValueError(f"topk_cuda runs on a CUDA device; logits are on {dev} (use topk_select or torch.topk)")
    for name, t in (("kv_lens", kv_lens), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}; logits on {dev}")
    out = torch.empty(B, topk, dtype=torch.int32, device=dev)
    if B == 0:
        return out
    kernel = _compiled(dev, threads, digit_bits, bool(agg), unroll, sample)
    cache_cap, cap, smem = layout(dev, T, digit_bits, cache)
    _set_smem(kernel, dev, smem)
    vec = int(logits.stride(0) % 4 == 0 and logits.data_ptr() % 16 == 0)
    kv_indices = kv_indices if kv_indices.numel() else kv_indptr  # never read; a valid pointer
    with torch.cuda.device(dev):  # the module was loaded in this device's context; its current stream
        kernel(grid=(B, 1, 1), block=(threads, 1, 1), shared_mem=smem,
               args=[logits, logits.stride(0), kv_lens, kv_indptr, kv_indices, page_size, topk, out, cache_cap, cap, vec])
    return out
