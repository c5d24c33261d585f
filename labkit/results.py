"""Run folders and result records: flat dicts written as Parquet, atomically, never overwritten.

A run folder is ``data/runs/<YYYYmmdd-HHMMSS>-<device>/``; each benchmark writes one or more
``<name>.parquet`` files of records into it; ``load_runs`` reads them back into one DataFrame.
A file appears whole or not at all: it is written to a temporary file in the same folder, fsync'ed,
then published by a hard link (no overwrite) or ``os.replace`` (overwrite).

Whatever fills a folder (``labkit run``, ``labkit.bench``, ``scripts/gpu_study.sh``) writes
``finished.json`` (``FINISHED``) into it last, and only when its work ended successfully: a folder
without it was killed, failed or is still being written, and ``load_runs`` says so per record
(``run_finished``, ``run_state``). The folder that notebooks run by hand record into
(``data/runs/interactive`` or ``$LABKIT_RUN_DIR``) never finishes: its state is ``interactive``.
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
FINISHED = "finished.json"  # the completion marker of a run folder
INTERACTIVE = "interactive"  # data/runs/interactive: notebooks run by hand, never finished
ACTIVE_RUN_ENV = "LABKIT_ACTIVE_RUN"  # set by labkit run while it fills that folder (its report reads it)
RUN_STATES = ("finished", "running", "interactive", "partial")


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


def mark_finished(run_dir, what: str, exit_status: int = 0, **extra) -> Path:
    """Write ``run_dir/finished.json`` (atomically): the end time (UTC), what ran, its exit status and
    ``extra``. Call it last, once the folder's work has ended successfully."""
    info = dict(finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), what=what,
                exit_status=int(exit_status), **extra)
    return atomic_write_text(Path(run_dir) / FINISHED, json.dumps(info, indent=1) + "\n")


def _same(a: Path, b) -> bool:
    try:
        return bool(b) and a.resolve() == Path(b).resolve()
    except OSError:
        return False


def run_state(folder) -> str:
    """``finished`` (it holds ``finished.json``), ``running`` (``labkit run`` is filling it now:
    the report inside that run), ``interactive`` (notebooks run by hand record there) or ``partial``
    (never finished: killed, failed or still being written by something else)."""
    folder = Path(folder)
    if (folder / FINISHED).is_file():
        return "finished"
    if _same(folder, os.environ.get(ACTIVE_RUN_ENV)):
        return "running"
    if folder.name == INTERACTIVE or _same(folder, os.environ.get("LABKIT_RUN_DIR")):
        return "interactive"
    return "partial"


def load_runs(*paths_or_globs) -> pd.DataFrame:
    """Every result Parquet under the given run folders (or files, or globs) as one DataFrame,
    with ``run`` (the run folder's name), ``file`` (the file's stem), ``run_state`` (``run_state``
    of the folder that holds the file) and ``run_finished`` (bool: that state is ``finished``)."""
    frames = []
    for run, f in _result_files(paths_or_globs):
        df = pd.read_parquet(f)
        state = run_state(f.parent)
        frames.append(df.assign(run=run, file=f.stem, run_state=state, run_finished=state == "finished"))
    if not frames:
        return pd.DataFrame(columns=["run", "file", "run_state", "run_finished"])
    return pd.concat(frames, ignore_index=True)


def unfinished_note(df: pd.DataFrame) -> str:
    """One line naming the runs whose records come from a folder that never finished; "" if none."""
    if "run_state" not in df or not len(df):
        return ""
    bad = sorted(df.run[df.run_state == "partial"].unique())
    return (f"partial: {len(bad)} run(s) never finished (killed, failed or still running), their records "
            f"are labelled '(partial)': {', '.join(bad)}") if bad else ""


def label_partial(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``run`` suffixed ``(partial)`` for the records of folders that never finished."""
    if "run_state" not in df or not len(df):
        return df
    partial = df.run_state == "partial"
    return df.assign(run=df.run.where(~partial, df.run.astype(str) + " (partial)"))
