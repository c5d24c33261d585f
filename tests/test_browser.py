"""The notebooks as a user meets them: JupyterLab from the project's venv, headless Chromium.

One server (127.0.0.1, a free port, no token) and one browser, driven from a thread while the rest
of the suite runs (``LabRuns``, a ``background`` scenario: tests/conftest.py). Its root holds
``RUN_WHOLE`` as committed (outputs dropped), each run with the menu Run -> Run All Cells, and the
other notebooks as `labkit run` executed them for tests/test_notebooks.py (conftest's
``notebook_run``), each opened without running as soon as that run has executed it: every notebook
runs once per check, not once per check and mode. Each is checked for what the page shows: every code cell numbered, no error output
(stderr warnings are fine, tracebacks are not) and, in notebooks whose code plots, at least one PNG
plot with a nonzero size. Full-notebook screenshots, the run notebooks' own records and figures
(``LABKIT_RUN_DIR``) and a ``browser.json`` summary go to a temporary folder (or to
``$LABKIT_RUN_DIR`` when set), printed on the terminal; never into ``data/``.

Skips, with the reason, only when Chromium is missing or does not launch (or the ``playwright``
package is missing); ``LABKIT_REQUIRE_BROWSER=1`` turns that skip into a failure.
``make test`` installs Chromium first where it can (root or passwordless sudo, apt).
Knobs: ``LABKIT_CHROMIUM`` (a Chromium binary), ``LABKIT_BROWSER_TIMEOUT`` (seconds per notebook).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

import browser as lb  # tests/browser.py
from labkit import runner

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = runner.notebooks()  # in run order: the report last
RUN_WHOLE = ("00_setup",)  # run from the UI (as is the self-check); the others are opened, as executed
TIMEOUT_S = float(os.environ.get("LABKIT_BROWSER_TIMEOUT", "600"))

pytestmark = pytest.mark.browser


def _unavailable(reason: str):
    if os.environ.get("LABKIT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"LABKIT_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(f"browser tests skipped: {reason}")


def _run_dir(tmp: Path) -> Path:
    """$LABKIT_RUN_DIR when set, else ``tmp``: tests never write into data/."""
    run_dir = Path(os.environ.get("LABKIT_RUN_DIR") or tmp)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _say(request, line: str, end: str = "") -> None:
    """A line on the terminal even while pytest captures output."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(f"\n{line}", end=end, flush=True)


SELFCHECK = "zz_selfcheck.ipynb"  # not a lab notebook: a warning, a plot, then an exception


def _write_selfcheck(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import warnings\nwarnings.warn('only a warning')",
        "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()",
        "raise ValueError('expected by the self-check')",
        "print('not reached: Run All stops at the exception')",
    )]
    nbformat.write(nb, str(path))


def _whole(nb: Path) -> bool:
    return nb.stem in RUN_WHOLE


class LabRuns:
    """The runs in JupyterLab: one server and one browser. The root holds RUN_WHOLE as committed
    (outputs dropped) and the self-check, both run from the UI at once; the other notebooks are
    copied in as `labkit run` executed them, each opened as soon as it has (``job.executed``).
    Kernels record into ``run_dir`` (``LABKIT_RUN_DIR``), beside the screenshots. Holds ``runs``
    (notebook name -> NotebookRun, the self-check's too), ``selfcheck_error``, ``reason`` (why there
    is no browser) and ``lines`` for the terminal."""

    def __init__(self, job):
        self.job, self.run_dir = job, _run_dir(job.tmp / "run")
        self.runs, self.lines, self.busy_s = {}, [], 0.0
        self.reason = self.selfcheck_error = None

    def run(self) -> "LabRuns":
        try:
            browser = self.job.browser()
        except lb.BrowserUnavailable as e:
            self.reason = str(e)
            return self
        self._serve(browser)
        return self

    def _serve(self, browser) -> None:
        root = self.job.tmp / "root"
        lb.copy_notebooks([nb for nb in NOTEBOOKS if _whole(nb)], root)
        _write_selfcheck(root / SELFCHECK)
        with lb.LabServer(root, state_dir=self.job.tmp / "state", env={"LABKIT_RUN_DIR": str(self.run_dir)}) as server:
            self.lines.append(f"browser run folder (screenshots, records): {self.run_dir}")
            try:
                self._notebooks(browser, server, whole=True)
                self._selfcheck(browser, server)
                self._notebooks(browser, server, whole=False)
            finally:
                runs = [self.runs[nb.name] for nb in NOTEBOOKS if nb.name in self.runs]
                (self.run_dir / "browser.json").write_text(json.dumps(
                    {"total_s": round(self.busy_s, 1), "notebooks": [r.summary() for r in runs]}, indent=1))
                if any(not r.done for r in runs):
                    shutil.copy(server.log_path, self.run_dir / "jupyter-lab.log")
        self.lines.append(f"browser: {len(runs)} notebooks in {self.busy_s:.0f} s -> {self.run_dir}")

    def _notebooks(self, browser, server, whole: bool) -> None:
        """RUN_WHOLE run from the UI (``whole``), or the others opened with their stored outputs, in order."""
        page = browser.new_page()
        try:
            for nb in NOTEBOOKS:
                if _whole(nb) != whole:
                    continue
                if not whole:
                    page.goto("about:blank")  # no JupyterLab polling its server while this waits
                executed = nb if whole else self.job.executed(nb.name)
                if executed is None or self.job.stop.is_set():  # the session ended first
                    return
                if not whole:
                    lb.copy_notebooks([executed], server.root_dir, strip_outputs=False)
                t0, shot = time.monotonic(), self.run_dir / lb.screenshot_name(nb)
                if whole:
                    r = lb.run_notebook_safely(page, server, nb.name, timeout=TIMEOUT_S, screenshot=shot)
                else:
                    r = lb.open_notebook_safely(page, server, nb.name, screenshot=shot)
                server.shutdown_kernels()
                self.busy_s += time.monotonic() - t0
                self.runs[nb.name] = r
                self.lines.append(f"  {nb.name} ({'run' if whole else 'opened'}): {r.seconds:.1f} s, "
                                  f"{r.numbered}/{r.expected} cells, "
                                  f"{len(r.errors)} errors, {len(r.warnings)} stderr, {r.plots} plots")
        finally:
            page.close()

    def _selfcheck(self, browser, server) -> None:
        page = browser.new_page()
        try:
            self.runs[SELFCHECK] = lb.run_notebook_in_lab(page, server, SELFCHECK, timeout=120)
        except Exception as e:  # noqa: BLE001  (raised again in the self-check's test)
            self.selfcheck_error = e
        finally:
            page.close()
            server.shutdown_kernels()


def _lab(job) -> LabRuns:
    """LabRuns, in a thread from the session's first test on (``background``, tests/conftest.py)."""
    return LabRuns(job).run()


@pytest.fixture(scope="module")
def lab_runs(background, notebook_run, request):
    """The notebooks' runs in JupyterLab (LabRuns.runs) once they have ended. ``notebook_run`` (not
    read here) starts `labkit run`, whose executed notebooks LabRuns opens."""
    if not NOTEBOOKS:
        pytest.skip(f"no notebooks in {NOTEBOOK_DIR}")
    lab = background(_lab)
    for i, line in enumerate(lab.lines):
        _say(request, line, end="\n" if i == len(lab.lines) - 1 else "")
    if lab.reason is not None:
        _unavailable(lab.reason)
    return lab


def _clip(texts, n=1500) -> str:
    return "\n---\n".join(t[-n:] for t in texts)


@pytest.mark.background.with_args(_lab)
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab(lab_runs, nb):
    r = lab_runs.runs[nb.name]
    where = f"(screenshot: {r.screenshot})"
    assert r.failure is None, f"{nb.name}: {r.failure} {where}"
    assert r.dialog is None, f"{nb.name}: a dialog blocked the run: {r.dialog!r} {where}"
    assert not r.errors, f"{nb.name} shows an error output {where}:\n{_clip(r.errors)}"
    assert not r.widget_errors, f"{nb.name}: widgets did not display {where}: {r.widget_errors}"
    assert r.numbered == r.expected, f"{nb.name}: {r.numbered} of {r.expected} code cells ran {where}"
    if lb.plots_expected(nb):
        assert r.plots >= 1, f"{nb.name} plots, but no PNG plot rendered {where}: sizes {r.images}"


@pytest.mark.background.with_args(_lab)
def test_checks_catch_an_exception_and_pass_a_warning(lab_runs):
    """The same checks on a notebook that warns, plots, then raises: the traceback is seen as an
    error, the warning is not, the plot is counted, and Run All stopped at the exception."""
    if lab_runs.selfcheck_error is not None:
        raise lab_runs.selfcheck_error
    r = lab_runs.runs[SELFCHECK]
    assert r.done and r.failure is None and r.dialog is None
    assert len(r.errors) == 1 and "ValueError: expected by the self-check" in r.errors[0], r.errors
    assert len(r.warnings) == 1 and "UserWarning: only a warning" in r.warnings[0], r.warnings
    assert r.plots == 1, r.images
    assert (r.numbered, r.expected) == (3, 4)


def test_error_text_rules():
    assert lb.is_error_text("Traceback (most recent call last):\n  File ...\nValueError: x")
    assert lb.is_error_text("---------\nValueError                 Traceback (most recent call last)")
    assert lb.is_error_text("torch.OutOfMemoryError: CUDA out of memory")
    assert lb.is_error_text("KeyboardInterrupt")
    assert not lb.is_error_text("/x/y.py:3: UserWarning: an Error may follow\n  warnings.warn(msg)")
    assert not lb.is_error_text("100%|##########| 3/3 [00:00<00:00]")
    assert not lb.is_error_text("USDT:2026 ... profiler_start")


def _repo_root(job) -> dict:
    """``jupyter lab`` at the repository root (a ``background`` scenario): its REST API's listing of
    notebooks/ and kernelspecs, then in Chromium (where there is one) the file browser's order of
    notebooks/ (``shown``; else ``reason``; ``error`` if the page failed)."""
    seen = dict(reason=None, error=None, shown=None)
    with lb.LabServer(REPO, state_dir=job.tmp / "state") as server:
        seen["listing"] = server.api("/api/contents/notebooks")
        seen["specs"] = server.api("/api/kernelspecs")["kernelspecs"]
        n = sum(i["type"] == "notebook" for i in seen["listing"]["content"])
        try:
            page = job.browser().new_page()
            try:
                page.goto(f"{server.url}/lab/tree/notebooks?reset", wait_until="domcontentloaded")
                page.wait_for_function(
                    "n => [...document.querySelectorAll('.jp-DirListing-item .jp-DirListing-itemText')]"
                    ".filter(e => e.textContent.endsWith('.ipynb')).length >= n", arg=n, timeout=60_000)
                seen["shown"] = [t for t in page.locator(".jp-DirListing-item .jp-DirListing-itemText")
                                 .all_text_contents() if t.endswith(".ipynb")]
            finally:
                page.close()
        except lb.BrowserUnavailable as e:
            seen["reason"] = str(e)
        except Exception as e:  # noqa: BLE001  (raised again in the test, after the API's checks)
            seen["error"] = e
    return seen


@pytest.mark.background.with_args(_repo_root)
def test_jupyterlab_at_repo_root_lists_notebooks_in_order(request, background):
    """``jupyter lab`` at the repository root: notebooks/ lists 00_... to NN_... in order, each
    with a kernel the server has; in Chromium (where there is one) the file browser shows that order."""
    on_disk = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    if not on_disk:
        pytest.skip(f"no notebooks in {NOTEBOOK_DIR}")
    seen = background(_repo_root)
    names = sorted(i["name"] for i in seen["listing"]["content"] if i["type"] == "notebook")
    assert names == on_disk
    prefixes = [re.match(r"(\d\d)_", n) for n in names]
    assert all(prefixes), f"every notebook name starts with a two-digit step: {names}"
    assert [int(m.group(1)) for m in prefixes] == list(range(len(names))), names
    specs = seen["specs"]
    for n in names:
        meta = json.loads((NOTEBOOK_DIR / n).read_text(encoding="utf-8"))["metadata"]
        ks = meta.get("kernelspec", {}).get("name")
        assert ks in specs, f"{n}: kernelspec {ks!r} is not one of the server's {sorted(specs)}"

    if seen["reason"] is not None:
        _say(request, f"file-browser order not checked in Chromium: {seen['reason']}")
        return
    if seen["error"] is not None:
        raise seen["error"]
    shown = seen["shown"]
    assert shown == names, f"the file browser shows {shown}"
