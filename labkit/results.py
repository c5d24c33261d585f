"""Run folders and result records: flat dicts written as Parquet, atomically, never overwritten.

A run folder is ``data/runs/<YYYYmmdd-HHMMSS>-<device>/``; each benchmark writes one or more
``<name>.parquet`` files of records into it; ``load_runs`` reads them back into one DataFrame.
A file appears whole or not at all: it is written to a temporary file in the same folder, fsync'ed,
then published by a hard link (no overwrite) or ``os.replace`` (overwrite).
"""
from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from .envinfo import REPO, device_tag, env_info  # noqa: F401  (env_info is part of this module's API)

RECORD_KEYS = ("path", "backend", "impl", "median_ms", "p20_ms", "p80_ms")


# -- atomic files ---------------------------------------------------------------------------
def _candidates(path: Path):
    """path, then ``stem-1.suffix``, ``stem-2.suffix``, ...: the names a no-overwrite write tries."""
    yield path
    n = 1
    while True:
        yield path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the data is already synced
        pass
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, overwrite: bool) -> Path:
    """Give ``tmp`` its final name; without ``overwrite`` the first free name from ``_candidates``."""
    if overwrite:
        os.replace(tmp, path)
        return path
    for cand in _candidates(path):
        try:
            os.link(tmp, cand)  # atomic and fails if cand exists: two writers cannot clobber each other
        except FileExistsError:
            continue
        except OSError:  # no hard links on this file system: check, then rename
            if cand.exists():
                continue
            os.replace(tmp, cand)
            return cand
        os.unlink(tmp)
        return cand
    raise AssertionError("unreachable")


def atomic_write_with(path, write: Callable[[Path], None], overwrite: bool = True) -> Path:
    """Call ``write(tmp_path)`` then publish the file as ``path``; returns the name it got.

    On any exception the temporary file is removed and an existing ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        write(tmp)
        _fsync_path(tmp)
        final = _publish(tmp, path, overwrite)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent, directory=True)
    return final


def atomic_write_bytes(path, data: bytes, overwrite: bool = True) -> Path:
    return atomic_write_with(path, lambda tmp: tmp.write_bytes(data), overwrite)


def atomic_write_text(path, data: str, overwrite: bool = True, encoding: str = "utf-8") -> Path:
    return atomic_write_with(path, lambda tmp: tmp.write_text(data, encoding=encoding), overwrite)


# -- records ------------------------------------------------------------------------------------
def _scalar(v):
    """A value Parquet stores in a flat column: scalars kept, containers as JSON, the rest as str."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
        return v.item()
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=str)
    return str(v)


def make_record(path: str, backend: str, impl: str, median_ms: float, p20_ms: float, p80_ms: float,
                params: dict, device_env: dict, **extra) -> dict:
    """One flat row: the timing, every run parameter, ``extra`` (gbps, tflops, peak extra bytes, ...)
    and the environment with keys prefixed ``env_``. A key given twice with two different values
    raises ``ValueError`` (the same value twice is fine, e.g. ``device`` in params and a Timing)."""
    rec = dict(path=path, backend=backend, impl=impl,
               median_ms=float(median_ms), p20_ms=float(p20_ms), p80_ms=float(p80_ms))
    parts = (params, extra, {f"env_{k}": v for k, v in device_env.items()})
    for part in parts:
        for k, v in part.items():
            v = _scalar(v)
            if k in rec and rec[k] != v:
                raise ValueError(f"record key {k!r} given twice: {rec[k]!r} and {v!r}")
            rec[k] = v
    return rec


def write_records(run_dir, records: Iterable[dict], name: str) -> Path:
    """Write ``records`` to ``run_dir/<name>.parquet``; if taken, ``<name>-1.parquet`` etc. Returns the path."""
    if "/" in name or os.sep in name:
        raise ValueError(f"name={name!r}: a file name, not a path")
    df = pd.DataFrame(list(records))
    if df.empty:
        raise ValueError(f"write_records({name!r}): no records to write")
    fname = name if name.endswith(".parquet") else f"{name}.parquet"
    return atomic_write_with(Path(run_dir) / fname, lambda tmp: df.to_parquet(tmp, index=False),
                             overwrite=False)


# -- run folders ----------------------------------------------------------------------------------
def _under_repo(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else REPO / p


def new_run_dir(base="data/runs", tag: str | None = None) -> Path:
    """Create ``<base>/<YYYYmmdd-HHMMSS>-<tag>`` (``-2``, ``-3`` ... if taken); relative ``base`` is
    under the repository root. ``tag`` defaults to the device tag (``cpu``, ``cuda-nvidia-h200``)."""
    base = _under_repo(base)
    base.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{tag or device_tag()}"
    for n in range(1, 10_000):
        d = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise RuntimeError(f"no free run folder name under {base} for {stem}")


def _expand(spec) -> list[Path]:
    """Paths matching ``spec`` (a path or a glob); relative ones are tried from the cwd, then the repo."""
    spec = str(spec)
    if glob.has_magic(spec):
        hits = sorted(glob.glob(spec)) or ([] if os.path.isabs(spec) else sorted(glob.glob(str(REPO / spec))))
        return [Path(h) for h in hits]
    p = Path(spec)
    if not p.exists() and not p.is_absolute() and (REPO / p).exists():
        p = REPO / p
    if not p.exists():
        raise FileNotFoundError(f"load_runs: {spec!r} does not exist (nor under {REPO})")
    return [p]


def _result_files(paths_or_globs) -> list[tuple[str, Path]]:
    """(run name, parquet file) pairs; a folder contributes every non-hidden parquet below it."""
    out = []
    for spec in paths_or_globs:
        for p in _expand(spec):
            if p.is_dir():
                out += [(p.name, f) for f in sorted(p.rglob("*.parquet")) if not f.name.startswith(".")]
            elif p.suffix == ".parquet":
                out.append((p.parent.name, p))
    seen, unique = set(), []
    for run, f in out:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append((run, f))
    return unique


def load_runs(*paths_or_globs) -> pd.DataFrame:
    """Every result Parquet under the given run folders (or files, or globs) as one DataFrame,
    with ``run`` (the run folder's name) and ``file`` (the file's stem) columns."""
    frames = []
    for run, f in _result_files(paths_or_globs):
        df = pd.read_parquet(f)
        frames.append(df.assign(run=run, file=f.stem))
    if not frames:
        return pd.DataFrame(columns=["run", "file"])
    return pd.concat(frames, ignore_index=True)
