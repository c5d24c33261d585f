"""Where one decode step's time goes: cast / gather / attention / merge / other, from torch.profiler.

    df = profile_decode_step(backend, q_nope, q_pe, pool, batch, sm_scale, trace_path=run / "trace.json")

On CUDA the times are kernel durations on the device (CUDA activity); on the CPU they are the
wall times of the top-level aten ops (CPU activity; Python overhead between ops is not counted).
``df.attrs["activity"]`` says which.

How work is attributed (first rule that applies; see ``categorize``):
1. an enclosing ``torch.profiler.record_function`` range named cast, gather, attention or merge
   (or, in a DSA step profiled with ``DSA_CATEGORIES``, index or topk);
2. work launched by an aten op inside a Python function listed in ``SCOPES`` (e.g. every op of
   ``attend_16bit``, the fp32 widening of q and rows included, is attention). While profiling, a
   ``sys.setprofile`` hook wraps each call of those functions in a ``record_function`` range
   ``labkit.scope:<name>``: Python frames reach the events that way on every torch version;
3. the aten op: ``to``/``_to_copy``/``copy_`` of floating data -> cast, ``index``/``gather`` ->
   gather, matmul/softmax/exp ops -> attention;
4. a kernel launched from Python (Triton) by its name: *merge* -> merge, *cast*/fp8_to_bf16/dequant
   -> cast, *gather* -> gather, *mla*/decode/attn -> attention;
5. anything else -> other.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from .results import atomic_write_with

CATEGORIES = ("cast", "gather", "attention", "merge", "other")
# a DSA step adds the lightning indexer in front: its logits ("index") and the top-k ("topk"), each
# attributed by a record_function range of that name (labkit.dsa)
DSA_CATEGORIES = ("index", "topk") + CATEGORIES
RANGES = DSA_CATEGORIES[:-1]  # record_function names that set a category
STEP_RANGE = "labkit.decode_step"
SCOPE_PREFIX = "labkit.scope:"
# Python functions whose whole body is one stage of the decode (labkit.torch_paths, labkit.reference,
# the launchers in labkit.kernels): their aten ops (q widening or quantizing, allocations) count there.
SCOPES = {"attend_16bit": "attention", "fp8_native": "attention", "mla_decode": "attention",
          "mla_decode_fp8": "attention", "quantize_q_fp8": "attention",
          "mla_decode_fp8_gluon": "attention", "mla_merge": "merge"}
_ATEN_RULES = (  # (category, op names), for aten ops outside any scope
    ("cast", {"aten::to", "aten::_to_copy", "aten::copy_"}),
    ("gather", {"aten::index", "aten::gather", "aten::index_select", "aten::take", "aten::embedding"}),
    ("attention", {"aten::mm", "aten::bmm", "aten::matmul", "aten::addmm", "aten::baddbmm", "aten::einsum",
                   "aten::softmax", "aten::_softmax", "aten::exp", "aten::logsumexp",
                   "aten::scaled_dot_product_attention"}),
)
_KERNEL_RULES = (  # (category, regex), for kernels and custom ops not launched by aten ops
    ("merge", re.compile(r"merge", re.I)),
    ("cast", re.compile(r"cast|fp8_to_bf16|to_bf16|dequant", re.I)),
    ("gather", re.compile(r"gather", re.I)),
    ("attention", re.compile(r"mla|decode|attn|attention|flash", re.I)),
)


def categorize(name: str, dtype: str | None = None, scopes=(), annotations=()) -> str:
    """Category of work named ``name`` (an aten op, or a kernel when no aten op launched it).

    dtype: the op's first input dtype as the profiler spells it (``c10::Float8_e4m3fn``, ``int``);
    scopes: names of the enclosing Python functions; annotations: enclosing record_function names;
    both innermost first.
    """
    for a in annotations:
        if a in RANGES:
            return a
    if name.startswith("aten::"):
        for f in scopes:
            if f in SCOPES:
                return SCOPES[f]
        for cat, ops in _ATEN_RULES:
            if name in ops:
                return "other" if cat == "cast" and not _floating(dtype) else cat
        return "other"
    for cat, pat in _KERNEL_RULES:
        if pat.search(name):
            return cat
    return next((SCOPES[f] for f in scopes if f in SCOPES), "other")


def _floating(dtype: str | None) -> bool:
    """Profiler dtype strings: float, double, c10::Half, c10::BFloat16, c10::Float8_*. None (unknown:
    torch 2.11 records no dtypes) counts as floating, so there an index conversion outside any
    scope (``kv_indices.long()``) counts as a (tiny) cast."""
    return dtype is None or dtype in ("float", "double") or dtype.startswith(("c10::Half", "c10::BFloat16", "c10::Float8"))


# -- Python scopes as record_function ranges ---------------------------------------------------------
class _ScopeRanges:
    """A ``sys.setprofile`` hook: a ``record_function`` range around each call of a ``SCOPES`` function."""

    def __enter__(self):
        self.open, self.prev = [], sys.getprofile()
        sys.setprofile(self)
        return self

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_name in SCOPES:
            rf = record_function(SCOPE_PREFIX + frame.f_code.co_name)
            rf.__enter__()
            self.open.append((frame, rf))
        elif event == "return" and self.open and self.open[-1][0] is frame:  # also on an exception
            self.open.pop()[1].__exit__(None, None, None)

    def __exit__(self, *exc):
        sys.setprofile(self.prev)
        while self.open:
            self.open.pop()[1].__exit__(None, None, None)


# -- walking the profiler's event tree --------------------------------------------------------------
def _is_note(e) -> bool:
    return bool(getattr(e, "is_user_annotation", False) or e.name == STEP_RANGE or e.name in RANGES
                or e.name.startswith(SCOPE_PREFIX))


def _is_aten(e) -> bool:
    return e.device_type == DeviceType.CPU and e.name.startswith("aten::")


def _context(e) -> tuple[object, list[str], list[str], bool]:
    """For the CPU event ``e``: its outermost aten op (``e`` itself included; None if none), the
    enclosing Python function names and record_function names (innermost first), and whether it
    ran inside the step range."""
    top, scopes, notes = None, [], []
    p = e
    while p is not None:
        if p.name.startswith(SCOPE_PREFIX):
            scopes.append(p.name[len(SCOPE_PREFIX):])
        elif _is_note(p):
            notes.append(p.name)
        elif _is_aten(p):
            top = p
        p = p.cpu_parent
    return top, scopes, notes, STEP_RANGE in notes


def _first_dtype(op) -> str | None:
    dts = getattr(op, "input_dtypes", None) or []
    return dts[0] if dts and dts[0] else None


def _cpu_rows(events) -> list[tuple[str, float]]:
    """(category, ms) per top-level aten op inside the step range."""
    rows = []
    for e in events:
        if not _is_aten(e):
            continue
        top, scopes, notes, inside = _context(e)
        if inside and top is e:
            rows.append((categorize(e.name, _first_dtype(e), scopes, notes), e.cpu_time_total / 1e3))
    return rows


_RUNTIME = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def _kernel_row(name: str, ms: float, ctx) -> tuple[str, float]:
    top, scopes, notes, _ = ctx
    op, dtype = (top.name, _first_dtype(top)) if top is not None else (name, None)
    return categorize(op, dtype, scopes, notes), ms


def _cuda_rows(events) -> list[tuple[str, float]]:
    """(category, ms) per device kernel, memcpy or memset launched inside the step range.

    Each device event counts once. Its context: the aten op or range the profiler hangs it on
    (``FunctionEvent.kernels``; internal events that also claim it are ignored), else the CPU
    runtime call with its correlation id (Triton launches on some torch versions), else none.
    """
    work = [k for k in events if k.device_type == DeviceType.CUDA and not _is_note(k)]  # ranges are no work
    left = Counter((k.name, k.time_range.end - k.time_range.start) for k in work)
    rows = []
    for e in events:
        if e.device_type != DeviceType.CPU or not e.kernels or not (_is_aten(e) or _is_note(e)):
            continue
        ctx = _context(e)
        for k in e.kernels:
            if left[(k.name, k.duration)] > 0:
                left[(k.name, k.duration)] -= 1
                if ctx[3]:
                    rows.append(_kernel_row(k.name, k.duration / 1e3, ctx))
    launches = {e.id: e for e in events if e.device_type == DeviceType.CPU and _RUNTIME.match(e.name)}
    for k in work:
        key = (k.name, k.time_range.end - k.time_range.start)
        if left[key] > 0:
            left[key] -= 1
            launch = launches.get(k.id)
            ctx = _context(launch) if launch is not None else (None, [], [STEP_RANGE], True)
            if ctx[3]:
                rows.append(_kernel_row(k.name, key[1] / 1e3, ctx))
    return rows


def _table(rows, activity: str, categories=CATEGORIES) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["category", "device_ms"])
    g = df.groupby("category")["device_ms"].agg(["sum", "count"]).reindex(list(categories), fill_value=0)
    total = float(g["sum"].sum())
    out = pd.DataFrame({"category": list(categories), "device_ms": g["sum"].astype(float).values,
                        "calls": g["count"].astype(int).values})
    out["share"] = out.device_ms / total if total else 0.0
    out.loc[len(out)] = dict(category="total", device_ms=total, calls=int(out.calls.sum()), share=1.0)
    out = out[["category", "device_ms", "share", "calls"]]
    out.attrs.update(activity=activity, total_ms=total)
    return out


def profile_decode_step(backend, q_nope, q_pe, pool, batch, sm_scale: float, layers=None,
                        trace_path=None, warmup: int = 1) -> pd.DataFrame:
    """Profile ``backend.decode`` over the layers of one step (all of the pool's by default; an int
    n means the first n; or a list of layer ids). Returns a DataFrame (category, device_ms, share,
    calls) with rows cast, gather, attention, merge, other and total; ``device_ms`` sums the step.
    Writes the Chrome trace to ``trace_path`` when given (atomically)."""
    ids = range(pool.num_layers) if layers is None else range(layers) if isinstance(layers, int) else list(layers)

    def work():
        for i in ids:
            backend.decode(q_nope, q_pe, pool, i, batch, sm_scale)

    df = profile_work(work, pool.device, trace_path=trace_path, warmup=warmup)
    df.attrs.update(layers=len(ids), backend=getattr(backend, "name", str(backend)))
    return df


def profile_work(work, device, categories=CATEGORIES, trace_path=None, warmup: int = 1) -> pd.DataFrame:
    """Profile one call of ``work()`` (a decode step of any kind) on ``device`` after ``warmup``
    calls: the same table as ``profile_decode_step``, one row per name in ``categories`` and a total."""
    cuda = torch.device(device).type == "cuda"

    def step():
        with record_function(STEP_RANGE):
            work()
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof, _ScopeRanges():
        step()
    events = prof.events()
    df = _table(_cuda_rows(events) if cuda else _cpu_rows(events), "cuda" if cuda else "cpu", categories)
    if trace_path is not None:
        atomic_write_with(Path(trace_path), lambda tmp: prof.export_chrome_trace(str(tmp)))
    df.attrs.update(trace_path=str(trace_path) if trace_path else None)
    return df
