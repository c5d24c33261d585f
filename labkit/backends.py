"""A registry of named decode backends with one call and capability rules as data.

    backend = select("fp8_native", q_nope, pool, batch, precision="fast")  # fastest allowed here
    out = backend.decode(q_nope, q_pe, pool, layer, batch, sm_scale)       # [B, H, 512]

    plan = backend.plan(pool, batch, num_heads, sm_scale)   # once per batch (a decode step)
    out = plan.run(q_nope, q_pe, layer, token_indices)      # every layer: no planning, no sync

Names are ``<path>.<impl>``: the path says what is done to the FP8 pool (``full_pool_cast``,
``gather_cast``, ``fp8_native``, or ``bf16_pool``: a 16-bit kernel on a pool already in BF16, the
best case a BF16 kernel can have), the implementation says by what (``torch``, ``triton``, ...).
A backend refuses before any launch, with a ``ValueError``, what its rules do not allow.

Precision is a rule of each implementation: ``accurate`` backends stay within 3e-3 relative error
of the float64 oracle (16-bit or split-FP8 arithmetic; every cast and BF16-pool path is accurate by
nature), ``fast`` ones may quantize the query or the probabilities to FP8 (~1e-2 to 3e-2). Where a
layout changes the arithmetic, ``layout_precision`` says so (``Backend.precision_on``): the rows
kernel reads fp8_ds_mla with a bf16 query and bf16 dots, accurate even in its fast form.
``select(..., precision="accurate")`` takes only accurate ones; ``precision="fast"`` takes any.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import torch_paths
from .kvpool import DecodeBatch, KVPool

PATHS = ("full_pool_cast", "gather_cast", "fp8_native", "bf16_pool")
PRECISIONS = ("fast", "accurate")
ALL_PAGE_SIZES = tuple(2**i for i in range(8))  # 1 .. 128
FP8_LAYOUTS = ("fp8_per_tensor",)  # what an FP8 backend reads unless it says more


@dataclass(frozen=True)
class Backend:
    name: str
    path: str
    impl: str
    fn: Callable = field(repr=False)
    kv_dtypes: tuple = ("fp8_e4m3", "bf16")
    kv_layouts: tuple = ("fp8_per_tensor", "bf16")  # labkit.kvlayout names
    dense_layouts: tuple | None = None  # for dense batches, if not kv_layouts
    precision: str = "accurate"  # "fast" or "accurate" (module docstring)
    layout_precision: tuple = ()  # (kv_layout, precision) pairs where a layout's arithmetic differs
    dense: bool = True  # takes dense batches (every token of the request's pages)
    sparse: bool = False  # takes sparse batches (top-k token slots per request)
    min_capability: tuple | None = None  # CUDA (major, minor); None: no CUDA needed
    max_capability: tuple | None = None  # e.g. (9, 0): wgmma exists on Hopper only
    runs_on_cpu: bool = True
    page_sizes: tuple = ALL_PAGE_SIZES
    sparse_page_sizes: tuple | None = None  # for sparse batches, if not page_sizes (rows read by id)
    max_heads: int = 128
    kernel: str = ""  # what does the attention, as the study names it
    note: str = ""
    # planner(pool, batch, num_heads, sm_scale, q_dtype) -> run(q_nope, q_pe, layer, batch_with_slots),
    # the per-batch work done once; None: ``run`` calls ``fn`` directly
    planner: Callable | None = field(default=None, repr=False)

    def precision_on(self, kv_layout: str) -> str:
        """The precision on a pool of ``kv_layout``: ``precision`` unless ``layout_precision`` names it."""
        return dict(self.layout_precision).get(kv_layout, self.precision)

    def check(self, q_nope: torch.Tensor, pool: KVPool, batch: DecodeBatch | None = None) -> None:
        """Raise ``ValueError`` naming the rule that this call breaks; nothing is launched."""
        dev = pool.device
        if pool.kv_dtype not in self.kv_dtypes:
            raise ValueError(
                f"backend {self.name!r} ({self.kernel or self.impl}) takes KV dtypes {list(self.kv_dtypes)}, "
                f"got {pool.dtype} (kv_dtype={pool.kv_dtype!r}); use a backend that reads it, e.g. 'fp8_native'"
            )
        if pool.kv_layout not in self.kv_layouts:
            raise ValueError(f"backend {self.name!r} reads kv_layout {list(self.kv_layouts)}, "
                             f"the pool is {pool.kv_layout!r}")
        if batch is not None:
            if not (self.sparse if batch.topk else self.dense):
                kind = "sparse (top-k token slots)" if batch.topk else "dense"
                raise ValueError(f"backend {self.name!r} takes {'sparse' if self.sparse else 'dense'} "
                                 f"batches only, this one is {kind}")
            if not batch.topk and self.dense_layouts is not None and pool.kv_layout not in self.dense_layouts:
                raise ValueError(f"backend {self.name!r} reads kv_layout {pool.kv_layout!r} in sparse batches only; "
                                 f"dense ones: {list(self.dense_layouts)}")
        if dev.type == "cpu" and not self.runs_on_cpu:
            raise ValueError(f"backend {self.name!r} needs a CUDA device; the pool is on the CPU")
        if dev.type == "cuda" and self.min_capability:
            cc = torch.cuda.get_device_capability(dev)
            if cc < self.min_capability:
                raise ValueError(
                    f"backend {self.name!r} needs compute capability >= {self.min_capability}, "
                    f"{torch.cuda.get_device_name(dev)} has {cc}"
                )
            if self.max_capability and cc > self.max_capability:
                raise ValueError(f"backend {self.name!r} runs on compute capability <= {self.max_capability} "
                                 f"(Hopper wgmma), {torch.cuda.get_device_name(dev)} has {cc}")
        sizes = self.sparse_page_sizes if batch is not None and batch.topk and self.sparse_page_sizes else \
            self.page_sizes
        if pool.page_size not in sizes:
            kind = "sparse" if sizes is self.sparse_page_sizes else "dense"
            raise ValueError(f"backend {self.name!r}: page_size={pool.page_size}; allowed {list(sizes)} ({kind})")
        if q_nope.shape[1] > self.max_heads:
            raise ValueError(f"backend {self.name!r}: {q_nope.shape[1]} heads; allowed 1..{self.max_heads}")

    def decode(self, q_nope, q_pe, pool: KVPool, layer: int, batch: DecodeBatch, sm_scale: float,
               token_indices: torch.Tensor | None = None):
        """q_nope [B, H, 512] bf16, q_pe [B, H, 64] bf16 -> out [B, H, 512] bf16.

        ``token_indices`` [B, topk] int32 (this layer's slots) overrides ``batch.slots(layer)``.
        Checks the rules on every call; a decode loop uses ``plan`` once and ``run`` per layer."""
        self.check(q_nope, pool, batch)
        return self.plan(pool, batch, q_nope.shape[1], sm_scale, q_nope.dtype).run(q_nope, q_pe, layer, token_indices)

    def plan(self, pool: KVPool, batch: DecodeBatch, num_heads: int, sm_scale: float,
             q_dtype: torch.dtype = torch.bfloat16) -> "DecodePlan":
        """What is fixed for a batch (splits, scratch, descriptors), computed once and cached."""
        key = (id(pool), id(batch), num_heads, sm_scale, q_dtype)
        plan = _PLANS.get(self.name, {}).get(key)
        if plan is None:
            run = self.planner(pool, batch, num_heads, sm_scale, q_dtype) if self.planner else None
            plan = DecodePlan(self, pool, batch, sm_scale, run)
            cache = _PLANS.setdefault(self.name, {})
            if len(cache) >= 8:  # plans hold scratch: keep a few per backend
                cache.pop(next(iter(cache)))
            cache[key] = plan
        return plan


@dataclass
class DecodePlan:
    """A backend bound to one pool and one batch; ``run`` is one layer's decode."""

    backend: Backend
    pool: KVPool
    batch: DecodeBatch
    sm_scale: float
    _run: Callable | None = field(default=None, repr=False)
    _at_layer: dict = field(default_factory=dict, repr=False)  # layer -> the batch with its own slots

    def run(self, q_nope, q_pe, layer: int, token_indices: torch.Tensor | None = None):
        """q_nope [B, H, 512], q_pe [B, H, 64] -> out [B, H, 512]; ``token_indices`` [B, topk] int32
        or None (the batch's slots of ``layer``; dense batches have none)."""
        batch = self.batch
        if token_indices is not None:
            batch = batch.with_slots(token_indices)
        elif batch.token_indices is not None:  # made once per layer: views of the batch's slots
            at = self._at_layer.get(layer)
            if at is None:
                at = self._at_layer[layer] = batch.with_slots(batch.slots(layer))
            batch = at
        if self._run is not None:
            return self._run(q_nope, q_pe, layer, batch)
        return self.backend.fn(q_nope, q_pe, self.pool, layer, batch, self.sm_scale)


_PLANS: dict[str, dict] = {}


def clear_plans() -> None:
    """Drop every cached plan (they hold their pools and scratch): between shapes of a sweep."""
    _PLANS.clear()


REGISTRY: dict[str, Backend] = {}
UNAVAILABLE: dict[str, str] = {}  # name -> why it is not registered here
_UNAVAILABLE_PATH: dict[str, tuple] = {}  # name -> (path, impl) of a backend that is not here


def mark_unavailable(name: str, path: str, impl: str, reason: str) -> None:
    UNAVAILABLE[name] = reason
    _UNAVAILABLE_PATH[name] = (path, impl)


def register(backend: Backend) -> Backend:
    REGISTRY[backend.name] = backend
    UNAVAILABLE.pop(backend.name, None)
    return backend


def get(name: str, device: str | torch.device | None = None) -> Backend:
    """A backend by full name (``fp8_native.torch``) or by path: then the first implementation that
    runs on ``device`` in the stated order of ``labkit.preferences`` (torch first on a CPU). With a
    call at hand, ``select`` is better: it knows the shape, the precision and the measured table."""
    from . import preferences

    _load_optional()
    if name in REGISTRY:
        return REGISTRY[name]
    if name in UNAVAILABLE:
        raise ValueError(f"backend {name!r} is not available here: {UNAVAILABLE[name]}")
    if name in PATHS:
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        order = preferences.FALLBACK.get(name, ()) if cuda else preferences.CPU_ORDER
        rest = [b.impl for b in REGISTRY.values() if b.path == name]
        for impl in (*order, *rest):
            b = REGISTRY.get(f"{name}.{impl}")
            if b and b.impl != "flashinfer" and (cuda or b.runs_on_cpu):
                return b
    raise ValueError(f"backend {name!r} is unknown; allowed: {sorted(REGISTRY) + list(PATHS)}")


def select(path: str, q_nope: torch.Tensor, pool: KVPool, batch: DecodeBatch, precision: str = "fast") -> Backend:
    """The fastest implementation of ``path`` whose rules allow this call, by the measured table of
    ``labkit.preferences`` for this GPU (its fallback order on a GPU it does not know; the torch
    paths first on a CPU). Peers (FlashInfer) are measured beside ours but never selected.

    precision: "fast" (any implementation) or "accurate" (relative error <= 3e-3 only)."""
    from . import preferences

    _load_optional()
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; allowed: {list(PRECISIONS)}")
    if path not in PATHS:
        raise ValueError(f"path={path!r}; allowed: {list(PATHS)}")
    arch = preferences.arch_of(pool.device)
    ranked, _ = preferences.order(path, arch, q_nope.shape[1], batch.batch_size, bool(batch.topk), precision,
                                  kv_layout=pool.kv_layout)
    rest = [b.impl for b in REGISTRY.values() if b.path == path and b.impl not in ranked]
    why = []
    for impl in (*ranked, *rest):
        b = REGISTRY.get(f"{path}.{impl}")
        if b is None or b.impl == "flashinfer":
            continue
        if precision == "accurate" and b.precision_on(pool.kv_layout) != "accurate":
            why.append(f"{b.name}: precision {b.precision_on(pool.kv_layout)!r} on {pool.kv_layout}")
            continue
        try:
            b.check(q_nope, pool, batch)
        except ValueError as e:
            why.append(str(e))
            continue
        return b
    raise ValueError(f"no implementation of {path!r} allows this call (precision={precision!r}): " + "; ".join(why))


def names(path: str | None = None) -> list[str]:
    _load_optional()
    return [n for n, b in REGISTRY.items() if path is None or b.path == path]


def capability_table() -> list[dict]:
    """One row per backend, registered or not: the rules a notebook prints."""
    _load_optional()
    rows = []
    for b in REGISTRY.values():
        rows.append(dict(backend=b.name, path=b.path, impl=b.impl, kernel=b.kernel,
                         kv_layouts=",".join(b.kv_layouts),
                         precision=" ".join([b.precision] + [f"({k}: {v})" for k, v in b.layout_precision]),
                         batches="/".join(k for k, on in (("dense", b.dense), ("sparse", b.sparse)) if on),
                         min_capability="-" if b.min_capability is None else "%d.%d" % b.min_capability,
                         cpu=b.runs_on_cpu, page_sizes=_span(b.page_sizes), max_heads=b.max_heads,
                         available=True, note=b.note))
    for n, why in UNAVAILABLE.items():
        path, impl = _UNAVAILABLE_PATH.get(n, (n.split(".")[0], n.split(".", 1)[-1]))
        rows.append(dict(backend=n, path=path, impl=impl, available=False, note=why))
    keys = list(rows[0])
    return [{k: r.get(k, "-") for k in keys} for r in rows]  # same columns, no gaps to fill


def _span(sizes) -> str:
    return ",".join(map(str, sizes)) if len(sizes) <= 3 else f"{min(sizes)}..{max(sizes)} (powers of 2)"


_loaded = False


def _load_optional() -> None:
    """Register implementations that need optional packages (Triton kernels, peers) once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in ("labkit.triton_paths", "labkit.peers"):
        try:
            __import__(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # the module exists but something it needs does not
                UNAVAILABLE[mod.rsplit(".", 1)[-1]] = f"import failed: {e}"


ALL_LAYOUTS = ("fp8_per_tensor", "fp8_ds_mla", "bf16")
register(Backend("full_pool_cast.torch", "full_pool_cast", "torch", torch_paths.full_pool_cast,
                 kv_layouts=ALL_LAYOUTS, sparse=True,
                 kernel="torch .to() + torch attention", note="casts the whole layer each call"))
register(Backend("gather_cast.torch", "gather_cast", "torch", torch_paths.gather_cast,
                 kv_layouts=ALL_LAYOUTS, sparse=True,
                 kernel="torch index + .to() + torch attention"))
register(Backend("fp8_native.torch", "fp8_native", "torch", torch_paths.fp8_native, kv_dtypes=("fp8_e4m3",),
                 kv_layouts=("fp8_per_tensor", "fp8_ds_mla"), sparse=True, kernel="torch tiles, fp32 widen per tile"))
register(Backend("bf16_pool.torch", "bf16_pool", "torch",
                 lambda qn, qp, pool, layer, batch, s: torch_paths.attend_16bit(qn, qp, pool.layer(layer), batch, s),
                 kv_dtypes=("bf16",), kv_layouts=("bf16",), sparse=True, kernel="torch attention, 16-bit KV only"))
