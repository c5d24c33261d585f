"""Run the notebooks with papermill into a new run folder ``data/runs/<timestamp>-<device>/``.

    p = plan(["01", "03"], profile="cpu-small", overrides={"pool_tokens": 32768})   # checks only
    run_dir = execute(p)                                                         # heavy work

``plan`` validates everything and touches no file, so a bad parameter leaves nothing behind.
``execute`` writes the executed notebooks, the records and figures the notebooks save, the
resolved parameters (``params.json``), the report as HTML and, last, ``finished.json``
(``results.FINISHED``). A notebook that fails, or Ctrl-C, stops the run; the folder is renamed
``<name>-failed`` and keeps the partial executed notebook, without ``finished.json``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import profiles
from .config import DATA_DIR, resolve_device
from .envinfo import device_tag
from .results import ACTIVE_RUN_ENV, atomic_write_text, mark_finished, new_run_dir

NOTEBOOKS_DIR = DATA_DIR.parent / "notebooks"
RUNS_DIR = DATA_DIR / "runs"
REPORT = "04_report"


class NotebookFailed(RuntimeError):
    def __init__(self, notebook: str, cell: int, exec_count, source: str, error: str, run_dir: Path):
        first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
        super().__init__(
            f"{notebook} failed in cell {cell} (In [{exec_count}]: `{first[:60]}`): {error}; "
            f"partial notebook kept in {run_dir}"
        )
        self.notebook, self.cell, self.run_dir = notebook, cell, run_dir


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during ``execute``; ``run_dir`` is the folder, renamed ``<name>-failed``."""

    def __init__(self, run_dir: Path):
        super().__init__(f"interrupted; partial run kept in {run_dir}")
        self.run_dir = run_dir


@dataclass
class Plan:
    notebooks: list  # [Path]
    params: dict
    profile: str
    device_tag: str
    command: str = field(default="")


def notebooks() -> list[Path]:
    """The notebooks in the order they run: by number, the report last (it reads the others' records)."""
    return _in_order(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


def _in_order(paths) -> list[Path]:
    return sorted(paths, key=lambda nb: (nb.stem == REPORT, nb.name))


def select(names=()) -> list[Path]:
    """All notebooks, or those named by number (``01``) or stem (``01_profile_full_pool_cast``)."""
    every = notebooks()
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).stem
        hits = [nb for nb in every if nb.stem == stem or nb.stem.split("_")[0] == stem]
        if not hits:
            raise ValueError(f"notebook {name!r} is unknown; allowed: {[nb.stem.split('_')[0] for nb in every]}")
        chosen += [nb for nb in hits if nb not in chosen]
    return _in_order(chosen)


def plan(names=(), profile: str | None = None, overrides: dict | None = None) -> Plan:
    """Everything ``execute`` needs, validated; raises ``ValueError`` (one line) on a bad input."""
    overrides = dict(overrides or {})
    for name in profiles.SET_BY_RUNNER:
        if name in overrides:
            raise ValueError(f"{name} is set by labkit run (a new folder under {RUNS_DIR}); do not pass it")
    chosen = select(names)
    if profile is None:
        profile = profiles.default_profile(overrides.get("device", "auto"))
    params = profiles.resolve(profile, overrides)
    return Plan(chosen, params, profile, device_tag(resolve_device(params["device"])))


def execute(p: Plan, base: Path | str = RUNS_DIR, progress: bool = True, log=None) -> Path:
    """Execute the planned notebooks into a new run folder; returns its path."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))  # sys.stderr looked up per call
    run_dir = new_run_dir(Path(base).resolve(), tag=p.device_tag)
    ran = [nb.stem for nb in p.notebooks]
    atomic_write_text(run_dir / "params.json", json.dumps(
        dict(profile=p.profile, notebooks=ran, params=p.params, command=p.command), indent=1))
    log(f"run folder {run_dir} (profile {p.profile}); kernel messages go to kernels.log there")
    try:
        with _stderr_to(run_dir / "kernels.log"), _library_logs_to(run_dir / "kernels.log"), _inline_plots(), \
                _active(run_dir):
            _execute_all(p, run_dir, progress, log)
    except KeyboardInterrupt:
        # the kernel got the same Ctrl-C; its client's pending task reports "Kernel died" when it is
        # collected, after this: the one-line verdict is what the terminal should show
        logging.getLogger("asyncio").disabled = True
        raise RunInterrupted(_failed(run_dir)) from None
    mark_finished(run_dir, p.command or "labkit run", notebooks=ran, profile=p.profile)
    return run_dir


def _failed(run_dir: Path) -> Path:
    """Rename the folder of a run that stopped to ``<name>-failed`` (once); returns the new path."""
    if run_dir.name.endswith("-failed") or not run_dir.exists():
        return run_dir
    failed = run_dir.with_name(run_dir.name + "-failed")
    run_dir.rename(failed)
    return failed


@contextlib.contextmanager
def _active(run_dir: Path):
    """Kernels started inside see ``$LABKIT_ACTIVE_RUN``: the report reads its own run as running."""
    saved = os.environ.get(ACTIVE_RUN_ENV)
    os.environ[ACTIVE_RUN_ENV] = str(run_dir)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ACTIVE_RUN_ENV, None)
        else:
            os.environ[ACTIVE_RUN_ENV] = saved


@contextlib.contextmanager
def _library_logs_to(path: Path):
    """papermill's, nbclient's and asyncio's log lines (a dying kernel's, say) go to ``path``, not to
    the terminal, where a run prints its progress lines and one verdict."""
    handler = logging.FileHandler(path)
    loggers = [logging.getLogger(n) for n in ("papermill", "nbclient", "traitlets", "asyncio")]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()


@contextlib.contextmanager
def _inline_plots():
    """Kernels draw figures into the notebooks even where MPLBACKEND names a file backend (agg)."""
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Kernels started inside inherit file descriptor 2 pointed at ``path``; this process keeps
    writing its own messages (and papermill's progress bar) to the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    terminal, sys.stderr = sys.stderr, os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield
    finally:
        sys.stderr.close()
        sys.stderr = terminal
        os.dup2(saved, 2)
        os.close(saved)


def _execute_all(p: Plan, run_dir: Path, progress: bool, log) -> None:
    import papermill as pm

    for i, nb in enumerate(p.notebooks, 1):
        out = run_dir / nb.name
        declared = pm.inspect_notebook(str(nb))
        params = {**p.params, "run_dir": str(run_dir), "interactive": False}  # no widgets in a batch run
        params = {k: v for k, v in params.items() if k in declared}
        log(f"[{i}/{len(p.notebooks)}] {nb.stem}")
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name="python3",
                                progress_bar=progress, cwd=str(nb.parent))
        except pm.PapermillExecutionError as e:
            if e.ename == "KeyboardInterrupt":  # Ctrl-C reached the kernel first
                raise KeyboardInterrupt from None
            raise NotebookFailed(nb.name, e.cell_index + 1, e.exec_count, e.source, f"{e.ename}: {e.evalue}",
                                 _failed(run_dir)) from None
        except KeyboardInterrupt:
            raise
        except BaseException:
            _failed(run_dir)
            raise
        log(f"      {nb.stem} done in {time.perf_counter() - t0:.1f} s")
        if nb.stem == REPORT:
            try:
                log(f"      report: {export_html(out)}")
            except Exception as e:  # e.g. nbconvert installed without its templates
                log(f"      report not exported to HTML ({type(e).__name__}: {str(e).splitlines()[0]})")


def export_html(notebook: Path) -> Path:
    """The executed notebook as one HTML page beside it, code cells hidden."""
    import nbformat
    from nbconvert import HTMLExporter

    found = template_dirs()
    # the templates' own share/jupyter on Jupyter's data path too: "lab" includes "base/null.j2",
    # which nbconvert looks up under the data path's nbconvert/templates roots, not the base dirs
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([*(str(t.parent.parent) for t in found), *filter(None, [saved])])
    try:
        body, _ = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True,
                               extra_template_basedirs=[os.getcwd(), *map(str, found)]  # cwd: the default
                               ).from_notebook_node(nbformat.read(notebook, as_version=4))
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = saved
    return atomic_write_text(notebook.with_suffix(".html"), body)


def template_dirs(package_file: str | None = None) -> list[Path]:
    """nbconvert's template folders (``.../share/jupyter/nbconvert/templates``) installed next to the
    nbconvert package at ``package_file`` (default: the one imported). ``pip install --target SITE``
    puts them in ``SITE/share/jupyter``, which is not on Jupyter's data path (JUPYTER_PATH); a
    prefix install puts them in ``PREFIX/share/jupyter`` beside ``PREFIX/lib/pythonX.Y/site-packages``."""
    if package_file is None:
        import nbconvert

        package_file = nbconvert.__file__
    site = Path(package_file).resolve().parent.parent  # the folder that holds the nbconvert package
    found = []
    for root in (site, *site.parents[:3]):
        templates = root / "share" / "jupyter" / "nbconvert" / "templates"
        if (templates / "lab").is_dir() and templates not in found:
            found.append(templates)
    return found
