"""GLM-5's DSA decode step, layer by layer: the lightning indexer, its top-k, sparse MLA attention.

    dl = dsa.build(p, run_dir=run)    # p.kv_layout; a few layers, the pool sized to the device
    prof = dsa.profile_step(dl, dsa.pick(dl, "gather_cast"))      # index/topk/cast/gather/attention/merge
    steps = dsa.step_model(profiles, dense, dl.p.cfg)             # 78 layers, tok/s per path

Each sparse layer of a decode step: the indexer's logits over every context token (``index``),
a top-k to ``index_topk`` token slots per request (``topk``: ``indexer.select_tokens``, its default:
the Triton kernel on CUDA, ``torch.topk`` on a CPU), then MLA over those slots only,
through a path (``full_pool_cast`` still casts the whole layer; ``gather_cast`` casts the selected
rows; ``fp8_native`` reads them in place; ``bf16_pool`` on a pool kept in BF16). GLM-5's first
``first_k_dense_replace`` (3) layers are dense MLA without an indexer. A few layers are measured;
the step is modelled to the model's layers plus the rest of the model (labkit.stepmodel).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import pandas as pd
import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from . import backends, config, kvlayout, measure, plots, reference
from .indexer import Indexer, select_tokens, slots_from_candidates
from .kvpool import DecodeBatch, batch_for_pool, make_queries, random_pool
from .lab import Lab, run_folder
from .lab import pick as pick_for_lab
from .profiles import STEP_TOPK_IMPLS
from .profiling import DSA_CATEGORIES, profile_work
from .stepmodel import rest_from_seed, tokens_per_s

SPARSE_PATHS = ("full_pool_cast", "gather_cast", "fp8_native", "bf16_pool")
BF16_ROW = kvlayout.KV_LAYOUTS["bf16"]  # 1152 B: a token cast to BF16
MEMORY_SHARE = 0.5  # of the device's memory for the measured pool: room for a BF16 layer and the index keys


@dataclass
class DsaLab:
    """A ``labkit.lab.Lab`` (pool of the measured layers, dense batch, MLA queries) with an indexer.

    sparse: the batch with the indexer's slots of every measured layer, int32 [layers, B, topk]
    index_impl: the indexer's logits implementation ("torch", "triton", "reference")
    topk_impl: the step's top-k: None (``select_tokens``' default), "torch", "triton", "cuda", or
        "candidates" (appended by the logits kernel, ``indexer.logits_with_candidates``; needs
        index_impl "triton")
    impl, precision: how each path's backend is picked (``pick``)
    """

    lab: Lab
    indexer: Indexer
    sparse: DecodeBatch
    index_impl: str
    impl: str = "auto"
    precision: str = "fast"
    topk_impl: str | None = None  # the step's top-k (Indexer.topk's topk_impl; None: select_tokens' default)
    bf16_lab: Lab | None = field(default=None, repr=False)  # layer 0 in BF16, made once (on_pool)

    @property
    def p(self) -> config.LabParams:
        return self.lab.p

    @property
    def topk(self) -> int:
        return self.indexer.index_topk

    def summary(self) -> str:
        c, pool = self.indexer.cfg, self.lab.pool
        return (f"{self.lab.summary()}; {pool.kv_layout} ({pool.bytes_per_token} B/token); DSA: "
                f"{c.index_n_heads} index heads x {c.index_head_dim}, top-{self.topk} "
                f"({self.sparse.tokens_read:,} of {self.sparse.num_tokens:,} context tokens read), "
                f"indexer {self.index_impl}, top-k {self.topk_impl or 'by device'}")


def index_impl(impl: str, device: str) -> str:
    """The indexer's logits for a path ``impl``: torch where asked and on a CPU (auto), else Triton."""
    cuda = str(device).startswith("cuda")
    return "torch" if impl == "torch" or (impl == "auto" and not cuda) else "triton"


def model_cfg(model: str, index_topk: int | None = None, index_n_heads: int | None = None) -> config.ModelConfig:
    """The model's config with the indexer's top-k and heads overridden where given."""
    cfg = config.load_model(model)
    for name, v in (("index_topk", index_topk), ("index_n_heads", index_n_heads)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r}: must be a positive integer (or None: the model's {getattr(cfg, name)})")
    cfg = replace(cfg, index_topk=index_topk or cfg.index_topk, index_n_heads=index_n_heads or cfg.index_n_heads)
    if not (cfg.index_topk and cfg.index_n_heads and cfg.index_head_dim):
        raise ValueError(f"model={model!r} has no DSA indexer (index_topk, index_n_heads, index_head_dim)")
    return cfg


def fit_layers(layers: int, pool_tokens: int, kv_layout: str, index_head_dim: int, device: str,
               share: float = MEMORY_SHARE) -> int:
    """How many of ``layers`` pool layers (KV rows + index keys) fit in ``share`` of the device's
    memory; at least 1. 64 x 128K tokens x 78 layers would need 377 GB in FP8: a few layers are
    measured and the step is modelled."""
    total = config._device_memory_bytes(device)
    per_layer = pool_tokens * (kvlayout.KV_LAYOUTS[kvlayout.check_layout(kv_layout)] + index_head_dim + 4)
    if not total:
        return layers
    return max(1, min(layers, int(share * total // per_layer)))


def build(p: config.LabParams, index_topk: int | None = None, index_n_heads: int | None = None,
          impl: str = "auto", precision: str = "fast", run_dir=None, warmup_ms: float = 25,
          rep_ms: float = 100, topk_impl: str | None = None) -> DsaLab:
    """Pool of ``p.kv_layout`` (``p.layers`` layers, fewer when they do not fit the device), dense
    batch, MLA queries, an indexer over every pool token, and the sparse batch of its top-k slots
    per layer. ``impl`` and ``precision`` pick each path's backend (``pick``) and the indexer's;
    ``topk_impl`` the step's top-k (``DsaLab.topk_impl``)."""
    kv_layout = p.kv_layout
    if topk_impl not in STEP_TOPK_IMPLS:
        raise ValueError(f"topk_impl={topk_impl!r}; allowed: {list(STEP_TOPK_IMPLS)}")
    if topk_impl == "candidates" and index_impl(impl, p.device) != "triton":
        raise ValueError(f"topk_impl='candidates' needs the Triton indexer (a CUDA device and impl 'auto' or a "
                         f"kernel), got impl={impl!r} on {p.device!r}")
    cfg = model_cfg(p.model, index_topk, index_n_heads)
    if p.device == "cpu":
        torch.set_num_threads(1)  # as labkit.lab.Lab: another process on a core stalls multi-threaded ops
    layers = fit_layers(p.layers, p.pool_tokens, kv_layout, cfg.index_head_dim, p.device)
    lab = Lab(p, None, None, None, None, run_folder(run_dir), warmup_ms, rep_ms)
    dl = _assemble(lab, cfg, index_impl(impl, p.device), layers, p.pool_tokens, p.lens, kv_layout)
    if topk_impl == "candidates":
        dl.indexer.sample_table()  # made once, before any timing or graph capture
    return replace(dl, impl=impl, precision=precision, topk_impl=topk_impl)


def _assemble(lab: Lab, cfg: config.ModelConfig, impl: str, layers: int, pool_tokens: int, lens,
              kv_layout: str) -> DsaLab:
    """``lab`` with a new pool, dense batch, queries and indexer."""
    p = lab.p
    pool = random_pool(layers, pool_tokens, p.page_size, kv_lora_rank=cfg.kv_lora_rank,
                       qk_rope_head_dim=cfg.qk_rope_head_dim, device=p.device, seed=p.seed, kv_layout=kv_layout)
    q_nope, q_pe = make_queries(len(lens), p.heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                device=p.device, seed=p.seed)
    lab = replace(lab, pool=pool, batch=batch_for_pool(pool, lens, p.seed), q_nope=q_nope, q_pe=q_pe)
    ix = Indexer(cfg, pool, lab.batch, seed=p.seed)
    return DsaLab(lab, ix, ix.sparse_batch(impl), impl)


def case(dl: DsaLab, batch_size: int, context: int) -> DsaLab:
    """One layer, ``batch_size`` requests of ``context`` tokens, on a pool (same layout) that just fits them."""
    ps = dl.p.page_size
    c = _assemble(dl.lab, dl.indexer.cfg, dl.index_impl, 1, batch_size * -(-context // ps) * ps,
                  [context] * batch_size, dl.lab.pool.kv_layout)
    if dl.topk_impl == "candidates":
        c.indexer.sample_table()
    return replace(c, impl=dl.impl, precision=dl.precision, topk_impl=dl.topk_impl)


# -- the step -----------------------------------------------------------------------------------------
def on_pool(dl: DsaLab, path: str) -> Lab:
    """The lab a path reads: ``bf16_pool`` gets layer 0 of the pool in BF16 (one layer, made once)."""
    if path != "bf16_pool" or dl.lab.pool.kv_layout == "bf16":
        return dl.lab
    if dl.bf16_lab is None:
        dl.bf16_lab = dl.lab.bf16()
    return dl.bf16_lab


def pick(dl: DsaLab, path: str, impl: str | None = None) -> backends.Backend:
    """The backend of ``path`` for the sparse batch: ``labkit.lab.pick`` (``auto``: ``backends.select`` at
    ``dl.precision``) or, when a named one refuses this sparse batch or layout, the first of its family
    that takes them, accurate ones first: e.g. ``fp8_native.triton`` is dense only,
    ``fp8_native.triton_rows_acc`` reads top-k rows. Raises the first refusal when none does."""
    lab = on_pool(dl, path)
    first = pick_for_lab(path, impl or dl.impl, dl.p.device, dl.precision, lab=replace(lab, batch=dl.sparse))
    family = [b for b in map(backends.get, backends.names(path)) if b.impl.startswith(first.impl)]  # peers: no dot
    family.sort(key=lambda b: b.precision_on(lab.pool.kv_layout) != "accurate")
    refusal = None
    for b in [first] + family:
        try:
            b.check(lab.q_nope, lab.pool, dl.sparse)
            return b
        except ValueError as e:
            refusal = refusal or e
    raise refusal


def sparse_layer(dl: DsaLab, plan, layer: int, kv_layer: int) -> torch.Tensor:
    """One DSA layer: the indexer's logits of ``layer`` [B, max_len], its top-k slots [B, topk] int32,
    then sparse MLA over ``kv_layer`` of the plan's pool -> out [B, H, 512] bf16."""
    lab, cand = dl.lab, dl.topk_impl == "candidates"  # candidates: kept by the logits kernel
    with record_function("index"):
        if cand:
            logits, kept = dl.indexer.logits_with_candidates(layer)
        else:
            logits = dl.indexer.logits(layer, dl.index_impl)
    with record_function("topk"):
        if cand:
            slots = slots_from_candidates(logits, dl.indexer.batch, dl.topk, kept)
        else:  # checked where tested
            slots = select_tokens(logits, dl.indexer.batch, dl.topk, check=False, topk_impl=dl.topk_impl)
    return plan.run(lab.q_nope, lab.q_pe, kv_layer, slots)


def step_work(dl: DsaLab, backend: backends.Backend):
    """A function running every measured layer of one DSA step through ``backend`` (planned once)."""
    lab = on_pool(dl, backend.path)
    plan = backend.plan(lab.pool, dl.sparse, lab.q_nope.shape[1], lab.sm_scale, lab.q_nope.dtype)
    layers = dl.indexer.num_layers

    def work():
        for i in range(layers):
            sparse_layer(dl, plan, i, i % lab.pool.num_layers)

    return work


def _median(profs: list[pd.DataFrame]) -> pd.DataFrame:
    df = profs[0].copy()
    df["device_ms"] = pd.concat([p.device_ms for p in profs], axis=1).median(axis=1)
    total = df.device_ms[df.category != "total"].sum()
    df.loc[df.category == "total", "device_ms"] = total
    df["share"] = df.device_ms / total if total else 0.0
    return df


def profile_step(dl: DsaLab, backend: backends.Backend, repeats: int | None = None, trace_path=None) -> pd.DataFrame:
    """The DSA step over the measured layers by category (``DSA_CATEGORIES`` and total): device_ms of
    the step (median of ``repeats`` profiles; None: 3, or 1 when 8 or more layers make the step),
    ms_per_layer, share; with the path and the shape. ``trace_path``: the first timed profile's
    Chrome trace (chrome://tracing, Perfetto)."""
    lab = on_pool(dl, backend.path)
    backend.check(lab.q_nope, lab.pool, dl.sparse)  # refuses before any work
    repeats = repeats or (1 if dl.indexer.num_layers >= 8 else 3)
    work = step_work(dl, backend)
    profs = [profile_work(work, lab.pool.device, DSA_CATEGORIES, trace_path=trace_path if i == 1 else None)
             for i in range(repeats + 1)][1:]  # the first: start-up
    df, n = _median(profs), dl.indexer.num_layers
    return df.assign(ms_per_layer=df.device_ms / n, layers_profiled=n, activity=profs[0].attrs["activity"],
                     **_labels(dl, backend))


def _labels(dl: DsaLab, backend) -> dict:
    s, c = dl.lab.shape(), dl.indexer.cfg
    return dict(path=backend.path, backend=backend.name, impl=backend.impl, kv_layout=dl.lab.pool.kv_layout,
                topk=dl.topk, index_n_heads=c.index_n_heads, index_impl=dl.index_impl,
                pool_tokens=s["pool_tokens"], batch_size=s["batch_size"], heads=s["heads"],
                context_len=s["context_len"], context_tokens=dl.sparse.num_tokens, tokens_read=dl.sparse.tokens_read)


def dense_layer(dl: DsaLab, backend: backends.Backend, repeats: int = 3) -> pd.DataFrame:
    """One dense MLA layer (GLM-5's first layers: no indexer) through ``backend`` on the same contexts,
    by category (``CATEGORIES`` and total), median of ``repeats``."""
    lab = on_pool(dl, backend.path)
    df = measure.profile_step(lab, backend, layers=[0], repeats=repeats)
    return df.assign(ms_per_layer=df.device_ms, **_labels(dl, backend), mode="dense")


# -- the paths, dense and sparse, against the oracle ----------------------------------------------------
def oracle(lab: Lab, batch: DecodeBatch, layer: int = 0) -> torch.Tensor:
    """float64 MLA over only the rows ``batch`` reads of ``layer`` (dense: its pages; sparse: the
    slots of that layer), dequantized: out [B, H, 512] float64. Never the whole layer in float64."""
    pool = lab.pool
    k_scale = 1.0 if pool.kv_layout in ("fp8_ds_mla", "bf16") else pool.scale(layer)
    slots = batch.slots(layer)
    if slots is None:
        kv = kvlayout.dequant(pool.layer(layer)[batch.kv_indices.long()], pool.kv_layout, k_scale, torch.float64)
        return reference.mla_decode(lab.q_nope, lab.q_pe, kv, batch.compact(), lab.sm_scale)
    B, k = slots.shape
    rows = pool.rows(layer)[slots.flatten().clamp_min(0).long()]  # [B * topk, row] as stored
    kv = kvlayout.dequant(rows, pool.kv_layout, k_scale, torch.float64)[:, None]  # one-token pages
    own = torch.arange(B * k, dtype=torch.int32, device=slots.device).view(B, k)
    compact = replace(batch, page_size=1, token_indices=torch.where(slots >= 0, own, -1))
    return reference.mla_decode(lab.q_nope, lab.q_pe, kv, compact, lab.sm_scale)


def dense_and_sparse(dl: DsaLab, paths=SPARSE_PATHS) -> pd.DataFrame:
    """Each path on the dense batch and on its sparse (top-k) version, layer 0: the time of a call
    (median_ms), the profiled kernels (device_ms, by category) and rel_err against the float64 oracle."""
    rows = []
    for path in paths:
        b = pick(dl, path)
        for mode, batch in (("dense", dl.sparse.with_slots(None)), ("sparse", dl.sparse)):
            lab = replace(on_pool(dl, path), batch=batch)
            err = reference.rel_err(lab.decode(b), oracle(lab, batch))
            row = measure.time_backend(lab, b, None, rel_err=err, experiment="dense_vs_sparse", mode=mode)
            rows.append({**row, **_labels(dl, b), "topk": batch.topk, "tokens_read": batch.tokens_read})
    return pd.DataFrame(rows)


# -- the whole-pool cast under DSA ----------------------------------------------------------------------
def cast_bytes(pool_tokens: int, kv_layout: str) -> int:
    """Bytes of one layer's whole-pool cast: read every stored row, write it in BF16 (1152 B)."""
    return pool_tokens * (kvlayout.KV_LAYOUTS[kv_layout] + BF16_ROW)


def attention_bytes(tokens_read: int, path: str, kv_layout: str) -> int:
    """KV bytes one layer's attention reads: BF16 rows after a cast, stored rows when FP8-native."""
    return tokens_read * (kvlayout.KV_LAYOUTS[kv_layout] if path == "fp8_native" else BF16_ROW)


def cast_under_dsa(profile: pd.DataFrame) -> dict:
    """From a ``profile_step`` of full_pool_cast: the cast against attention, bytes and time per layer."""
    t = profile.set_index("category").ms_per_layer
    r = profile.iloc[0]
    cast_b, attn_b = cast_bytes(r.pool_tokens, r.kv_layout), attention_bytes(r.tokens_read, r.path, r.kv_layout)
    return dict(path=r.path, backend=r.backend, kv_layout=r.kv_layout, pool_tokens=r.pool_tokens,
                tokens_read=r.tokens_read, topk=r.topk, batch_size=r.batch_size, context_len=r.context_len,
                cast_bytes=cast_b, attention_bytes=attn_b, bytes_ratio=cast_b / attn_b,
                cast_ms=t["cast"], attention_ms=t["attention"], index_ms=t["index"], topk_ms=t["topk"],
                layer_ms=t["total"], cast_share=t["cast"] / t["total"], time_ratio=t["cast"] / t["attention"])


def context_sweep(dl: DsaLab, contexts, batch_size: int, paths=SPARSE_PATHS, repeats: int = 1) -> pd.DataFrame:
    """The DSA layer by category per path at each context length (``batch_size`` requests, a one-layer
    pool that just fits them): attention reads top-k tokens per request, the pool grows with the context.
    With each path's dense layer there too, the modelled step (``step_model``) per path and context.
    ``repeats``: profiles per point (median)."""
    rows = []
    for n in tqdm(list(contexts), desc="contexts", unit="point"):
        c = case(dl, batch_size, n)
        runs = [(b, profile_step(c, b, repeats), dense_layer(c, b, repeats)) for b in (pick(c, path) for path in paths)]
        steps = step_model(pd.concat([r[1] for r in runs]), pd.concat([r[2] for r in runs]), c.indexer.cfg)
        for (b, prof, _), step in zip(runs, steps.itertuples()):
            t = prof.set_index("category").ms_per_layer
            rows.append(dict(**_labels(c, b), **{f"{k}_ms": t[k] for k in (*DSA_CATEGORIES, "total")},
                             cast_bytes=cast_bytes(c.lab.pool.pool_tokens, c.lab.pool.kv_layout),
                             dense_ms=step.dense_ms, step_ms=step.step_ms, tok_s=step.tok_s,
                             step_cast_share=step.cast_share, experiment="dsa_context_sweep", median_ms=t["total"]))
        del c, runs  # free this pool (on a GPU up to 8.4M tokens) before the next is drawn
        backends.clear_plans()  # cached plans hold the pool too
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


# -- the decode-step model -------------------------------------------------------------------------------
def dsa_step_ms(dense_ms: float, sparse_ms: float, layers: int, dense_layers: int, rest_ms: float) -> float:
    """One DSA decode step in ms: ``dense_layers`` dense MLA layers, the others indexer + top-k +
    sparse MLA (``sparse_ms`` per layer, all three), plus the rest of the model."""
    if not 0 <= dense_layers <= layers:
        raise ValueError(f"dense_layers={dense_layers}: allowed 0..layers={layers}")
    return dense_layers * dense_ms + (layers - dense_layers) * sparse_ms + rest_ms


def step_model(profiles: pd.DataFrame, dense: pd.DataFrame, cfg: config.ModelConfig,
               rest_ms: float | None = None, batch: int | None = None) -> pd.DataFrame:
    """Step time and tok/s per path: ``profiles`` (``profile_step`` rows, concatenated) give the sparse
    layer by category, ``dense`` (``dense_layer`` rows) the dense one; ``cfg`` the layers
    (num_hidden_layers, first_k_dense_replace). ``rest_ms``: the seed's rest of the step (its
    attention kernel included, so the step is an upper bound). The cast's share: of the whole step."""
    rest = rest_from_seed() if rest_ms is None else rest_ms
    L, k = cfg.num_hidden_layers, cfg.first_k_dense_replace
    rows = []
    for path, prof in profiles.groupby("path", sort=False):
        t = prof.set_index("category").ms_per_layer
        d = dense[dense.path == path].set_index("category").ms_per_layer
        s = dsa_step_ms(d["total"], t["total"], L, k, rest)
        cast = k * d["cast"] + (L - k) * t["cast"]
        B = int(prof.batch_size.iloc[0]) if batch is None else batch
        rows.append(dict(path=path, backend=prof.backend.iloc[0], layers=L, dense_layers=k, dense_ms=d["total"],
                         index_ms=t["index"], topk_ms=t["topk"], sparse_attn_ms=t["total"] - t["index"] - t["topk"],
                         sparse_ms=t["total"], rest_ms=rest, step_ms=s, tok_s=tokens_per_s(s, B), batch_size=B,
                         cast_ms=cast, cast_share=cast / s, kv_layout=prof.kv_layout.iloc[0], topk=prof.topk.iloc[0],
                         experiment="dsa_step_model"))
    return pd.DataFrame(rows)


# -- peers -------------------------------------------------------------------------------------------------
FLASHINFER = (("flashinfer_mla", True), ("flashinfer_mla_fp8", False))  # (backend, on the BF16 copy)


def peers(dl: DsaLab) -> pd.DataFrame:
    """FlashInfer's MLA kernel as a sparse decode on a BF16 and an FP8 pool, where labkit registers it
    for sparse batches; checked against the oracle, then timed. A missing peer is a row saying why,
    and so is one that fails at run time (an error of the library, recorded, not raised)."""
    rows = []
    for name, on_bf16 in FLASHINFER:
        label = name + (" [BF16 pool]" if on_bf16 else " [FP8 pool]")
        lab = replace(on_pool(dl, "bf16_pool") if on_bf16 else dl.lab, batch=dl.sparse)
        try:
            b = backends.get(name)
            b.check(lab.q_nope, lab.pool, dl.sparse)
        except ValueError as e:
            rows.append(dict(label=label, backend=name, note=str(e)))
            continue
        try:
            err = reference.rel_err(lab.decode(b), oracle(lab, dl.sparse))
            row = measure.time_backend(lab, b, None, rel_err=err, experiment="dsa_peers")
        except RuntimeError as e:
            rows.append(dict(label=label, backend=name, note=f"failed: {type(e).__name__}: {str(e)[:300]}"))
            continue
        rows.append(dict(label=label, note="", **{**row, **_labels(dl, b)}))
    return pd.DataFrame(rows)


# -- figures (each returns the axes) ------------------------------------------------------------------------
def plot_step_profile(profiles: pd.DataFrame, ax=None):
    """Stacked bars: ms per DSA layer by category, one bar per backend."""
    from .plots import CATEGORY_COLORS

    ax = plots._axes(ax, (6.5, 3.6))
    colors = {"index": "tab:green", "topk": "tab:olive", **CATEGORY_COLORS}
    t = profiles[profiles.category != "total"].pivot_table(index="backend", columns="category",
                                                           values="ms_per_layer", sort=False)
    left = 0
    for cat in [c for c in DSA_CATEGORIES if c in t]:
        ax.barh(t.index, t[cat], left=left, color=colors[cat], label=cat)
        left = left + t[cat]
    ax.invert_yaxis()
    ax.set(xlabel="ms per sparse layer (profiled)", title="one DSA layer by category")
    ax.legend(fontsize=7, ncol=4)
    return ax


def plot_dense_sparse(rows: pd.DataFrame, ax=None):
    """Device time per layer of each path, dense beside sparse (top-k), rel_err in the labels."""
    import numpy as np

    ax = plots._axes(ax, plots.FIG_SIZE)
    t = rows.pivot_table(index="path", columns="mode", values="device_ms", sort=False) * 1e3
    x = np.arange(len(t))
    for j, mode in enumerate(("dense", "sparse")):
        ax.bar(x + (j - 0.5) * 0.4, t[mode], 0.4, label=mode)
    ax.set_xticks(x, t.index, fontsize=8)
    ax.set(ylabel="device time per layer (us)", yscale="log", title="the paths on dense and top-k batches")
    ax.legend(fontsize=8)
    return ax


def plot_context_sweep(sw: pd.DataFrame, ax=None):
    """ms per DSA layer against context: each path's total, and full_pool_cast's cast and attention."""
    ax = plots._axes(ax, plots.FIG_SIZE)
    for path, g in sw.sort_values("context_len").groupby("path", sort=False):
        ax.plot(g.context_len, g.total_ms, "o-", ms=3, label=f"{path} (layer)")
    f = sw[sw.path == "full_pool_cast"].sort_values("context_len")
    if len(f):
        ax.plot(f.context_len, f.cast_ms, "k:", label="full_pool_cast: cast")
        ax.plot(f.context_len, f.index_ms + f.topk_ms, "g--", label="indexer + top-k")
    ax.set(xscale="log", yscale="log", xlabel="tokens per request (pool = batch x context)",
           ylabel="ms per layer (profiled)", title=f"top-{sw.topk.iloc[0]}: attention stays, the cast grows")
    ax.legend(fontsize=7)
    return ax


def plot_tok_s(steps: pd.DataFrame, ax=None):
    """Modelled tok/s per path of the DSA step, with the cast's share of the step in the labels."""
    ax = plots._axes(ax, plots.FIG_SIZE)
    ax.bar(steps.path, steps.tok_s, color="tab:blue")
    for x, (v, c) in enumerate(zip(steps.tok_s, steps.cast_share)):
        ax.annotate(f"{v:,.1f}\n(cast {c:.0%})", (x, v), ha="center", va="bottom", fontsize=8)
    r = steps.iloc[0]
    ax.set(ylabel="tokens/s", ylim=(0, steps.tok_s.max() * 1.3),
           title=f"DSA decode step: {r.layers} layers ({r.dense_layers} dense), batch {r.batch_size}")
    return ax


def plot_tok_s_vs_context(sw: pd.DataFrame, ax=None):
    """Modelled tok/s of the DSA step per path against context length (the sweep's batch)."""
    ax = plots._axes(ax, plots.FIG_SIZE)
    for path, g in sw.sort_values("context_len").groupby("path", sort=False):
        ax.plot(g.context_len, g.tok_s, "o-", ms=3, label=path)
    ax.set(xscale="log", yscale="log", xlabel="tokens per request", ylabel="tokens/s (modelled step)",
           title=f"DSA step, {sw.batch_size.iloc[0]} requests, top-{sw.topk.iloc[0]}")
    ax.legend(fontsize=7)
    return ax
