"""Named parameter sets for the notebooks, as data, and the check every set passes before a run.

``DEFAULTS`` are the values stored in the notebooks' ``parameters`` cells: the smallest run, fast
on a CPU (what ``pytest --nbval-lax`` executes). A profile overrides some of them:

    cpu-small   default on a CPU: tiny model, small pool, torch paths (``make lab``)
    cpu-triton  the Triton kernels in Triton's CPU interpreter: one layer, very small shapes
    gpu-quick   GLM-5 shapes, 4 layers, smaller pool: a few minutes on one GPU
    gpu-seed    the study's scale: GLM-5, 78 layers, 495K-token pool, tp 4 -> 16 heads per GPU
"""
from __future__ import annotations

from .config import LabParams

PAGE_SIZE = 64
SEED_POOL_TOKENS = -(-495_000 // PAGE_SIZE) * PAGE_SIZE  # 495,040: the study's 495K pool in whole pages
# auto: backends.select, the fastest implementation measured here that allows the call (torch on a
# CPU); any other name picks that implementation where the path has it (select elsewhere)
IMPLS = ("auto", "torch", "triton", "seed", "triton_q8", "gluon", "gluon_acc", "triton_rows", "triton_rows_acc", "flashinfer")
STEP_TOPK_IMPLS = (None, "torch", "triton", "cuda", "candidates")  # labkit.dsa.DsaLab.topk_impl
PRECISIONS = ("fast", "accurate")  # backends.PRECISIONS: accurate = rel. error <= 3e-3

DEFAULTS = dict(
    # the model, the pool and the batch (labkit.config.LabParams)
    model="tiny", num_layers=2, tp_size=1, pool_tokens=8192, page_size=PAGE_SIZE,
    batch_size=2, context_lens=512, kv_dtype="fp8_e4m3", device="auto", seed=0,
    # how paths are picked and timed
    impl="auto", precision="fast", warmup_ms=5, rep_ms=20,
    # sweeps (01, 02, 03)
    pool_sweep=[2048, 8192, 32768],  # pool tokens; the batch stays the same
    batch_sweep=[1, 4, 8, 16],  # requests of context_lens tokens, at pool_tokens
    heads_sweep=[8, 16, 32, 64, 128],  # heads per GPU, at sweep_batch x sweep_context
    context_sweep=[256, 1024],  # tokens per request, at sweep_batch and the model's heads per GPU
    sweep_batch=2,
    sweep_context=512,
    # DSA sparse decode (05): None = the model's index_topk / index_n_heads
    index_topk=None, index_n_heads=None,
    kv_layout=None,  # labkit.kvlayout name: None = kv_dtype's own (fp8_per_tensor, bf16); or fp8_ds_mla
    topk_impl=None,  # the DSA step's top-k (STEP_TOPK_IMPLS): None = by device and shape (indexer.default_topk_impl:
    # CUDA C or Triton on a GPU, torch on a CPU); "cuda", "triton", "candidates" (GPU)
    sparse_contexts=[128, 512],  # tokens per request, at sparse_batch requests (one shorter than tiny's top-256)
    sparse_batch=2,
    # where records and figures go (set by labkit run; None: data/runs/interactive)
    run_dir=None,
    runs=[],  # 04: more run folders or globs to report beside run_dir
    interactive=True,  # 03: sliders over the stored results (JupyterLab); labkit run sets False
)

PROFILES = {
    "cpu-small": dict(
        pool_tokens=16384, batch_size=4, context_lens=1024, warmup_ms=20, rep_ms=150,
        pool_sweep=[4096, 16384, 65536, 131072], batch_sweep=[1, 4, 8, 12, 16],
        context_sweep=[256, 1024, 4096], sweep_batch=4, sweep_context=1024,
        sparse_contexts=[128, 1024, 4096], sparse_batch=4,
    ),
    "cpu-triton": dict(
        impl="triton", num_layers=1, pool_tokens=4096, batch_size=2, context_lens=256, warmup_ms=1, rep_ms=1,
        pool_sweep=[1024, 4096, 16384], batch_sweep=[1, 4, 8, 16], heads_sweep=[8, 16, 64],
        context_sweep=[64, 256], sweep_batch=2, sweep_context=256,
        sparse_contexts=[384], sparse_batch=1,  # the interpreter: one small point
    ),
    "gpu-quick": dict(
        model="glm5", num_layers=4, tp_size=4, pool_tokens=131072, batch_size=1, context_lens=8192,
        warmup_ms=25, rep_ms=100, pool_sweep=[16384, 32768, 65536, 131072],
        batch_sweep=[1, 4, 8, 16], context_sweep=[1024, 8192, 32768], sweep_batch=16, sweep_context=8192,
        sparse_contexts=[4096, 32768], sparse_batch=16,
    ),
    "gpu-seed": dict(
        model="glm5", num_layers=None, tp_size=4, pool_tokens=SEED_POOL_TOKENS, batch_size=1,
        context_lens=8192, warmup_ms=25, rep_ms=100,
        pool_sweep=[32768, 65536, 131072, 262144, SEED_POOL_TOKENS],
        batch_sweep=[1, 8, 16, 32, 48, 60],  # 60 x 8K reads 99% of the pool
        context_sweep=[1024, 4096, 8192, 32768], sweep_batch=64, sweep_context=8192,
        # 64 requests x up to 128K tokens: one fitted layer per context (8.4M tokens at 128K)
        sparse_contexts=[2048, 8192, 32768, 131072], sparse_batch=64,
    ),
}

LAB_FIELDS = tuple(f for f in LabParams.__dataclass_fields__ if f not in ("cfg", "lens"))
SET_BY_RUNNER = ("run_dir", "interactive")


def default_profile(device: str = "auto") -> str:
    """``gpu-seed`` where CUDA is available, ``cpu-small`` elsewhere."""
    from .config import resolve_device

    return "gpu-seed" if resolve_device(device).startswith("cuda") else "cpu-small"


def resolve(profile: str | None = None, overrides: dict | None = None) -> dict:
    """DEFAULTS, then the profile, then the overrides, checked: a ``ValueError`` names what is wrong."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is unknown; allowed: {sorted(PROFILES)}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        allowed = sorted(set(DEFAULTS) - set(SET_BY_RUNNER))
        raise ValueError(f"unknown parameter(s) {unknown}; allowed: {allowed}")
    params = {**DEFAULTS, **PROFILES.get(profile, {}), **overrides}
    check(params)
    return params


def check(params: dict) -> LabParams:
    """Validate a full parameter set; returns the LabParams it describes."""
    p = LabParams.make(**{k: params[k] for k in LAB_FIELDS if k in params})
    if params.get("impl") not in IMPLS:
        raise ValueError(f"impl={params.get('impl')!r}; allowed: {list(IMPLS)}")
    if params.get("precision") not in PRECISIONS:
        raise ValueError(f"precision={params.get('precision')!r}; allowed: {list(PRECISIONS)}")
    for name in ("warmup_ms", "rep_ms"):
        v = params[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{name}={v!r}: must be a positive number of milliseconds")
    for name in ("sweep_batch", "sweep_context", "sparse_batch"):
        _positive_ints(name, [params[name]], scalar=True)
    if params.get("topk_impl") not in STEP_TOPK_IMPLS:
        raise ValueError(f"topk_impl={params.get('topk_impl')!r}; allowed: {list(STEP_TOPK_IMPLS)}")
    for name in ("index_topk", "index_n_heads"):
        if params[name] is not None:
            _positive_ints(name, [params[name]], scalar=True)
    _positive_ints("sparse_contexts", params["sparse_contexts"])
    _positive_ints("pool_sweep", params["pool_sweep"])
    _positive_ints("batch_sweep", params["batch_sweep"])
    _positive_ints("context_sweep", params["context_sweep"])
    _positive_ints("heads_sweep", params["heads_sweep"], hi=128)
    runs = params["runs"]
    if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
        raise ValueError(f"runs={runs!r}: allowed a list of run folders or globs, e.g. '[\"data/runs/*-cpu\"]'")
    need = sum(-(-n // p.page_size) for n in p.lens) * p.page_size
    for v in params["pool_sweep"]:
        if v % p.page_size or v < need:
            raise ValueError(
                f"pool_sweep entry {v}: allowed multiples of page_size={p.page_size} "
                f">= {need} (the pages the batch reads)"
            )
    per_req = -(-max(p.lens) // p.page_size)
    most = p.num_pages // per_req
    if max(params["batch_sweep"]) > most:
        raise ValueError(
            f"batch_sweep entry {max(params['batch_sweep'])}: allowed 1..{most} requests "
            f"of {max(p.lens)} tokens in pool_tokens={p.pool_tokens}"
        )
    return p


def _positive_ints(name, values, hi=None, scalar=False):
    what = "a positive integer" if scalar else "a non-empty list of positive integers"
    if hi:
        what += f" up to {hi}"
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name}={values!r}: allowed {what}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (hi and v > hi):
            raise ValueError(f"{name}={values[0] if scalar else values!r}: allowed {what}")
