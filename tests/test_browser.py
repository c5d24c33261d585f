"""The notebooks as a user meets them: JupyterLab from the project's venv, headless Chromium.

One server (127.0.0.1, a free port, no token) and one browser for the module. Its root holds
``RUN_WHOLE`` as committed (outputs dropped), each run with the menu Run -> Run All Cells, and the
other notebooks as `labkit run` executed them for tests/test_notebooks.py (conftest's
``notebook_run``), opened without running: every notebook runs once per check, not once per check
and mode. Each is checked for what the page shows: every code cell numbered, no error output
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


@pytest.fixture(scope="module")
def chromium_or_reason():
    """(a Playwright browser on the local Chromium, None), or (None, why there is none).
    One per module: Playwright's sync API allows one session at a time in a thread."""
    with contextlib.ExitStack() as stack:
        try:
            yield stack.enter_context(lb.open_browser()), None
        except lb.BrowserUnavailable as e:
            yield None, str(e)


@pytest.fixture(scope="module")
def chromium(chromium_or_reason):
    """The browser; skips (saying what is missing) if there is none."""
    browser, reason = chromium_or_reason
    if browser is None:
        _unavailable(reason)
    return browser


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


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory, notebook_run):
    """One JupyterLab for the module; root: RUN_WHOLE as committed (outputs dropped), the others as
    executed by `labkit run`, and the self-check. Its kernels record into the run folder
    (``LABKIT_RUN_DIR``), beside the screenshots."""
    tmp = tmp_path_factory.mktemp("lab")
    lb.copy_notebooks([nb for nb in NOTEBOOKS if _whole(nb)], tmp / "root")
    executed = [notebook_run[0] / nb.name for nb in NOTEBOOKS if not _whole(nb)]
    lb.copy_notebooks(executed, tmp / "root", strip_outputs=False)
    _write_selfcheck(tmp / "root" / SELFCHECK)
    run_dir = _run_dir(tmp / "run")
    with lb.LabServer(tmp / "root", state_dir=tmp / "state", env={"LABKIT_RUN_DIR": str(run_dir)}) as server:
        server.run_dir = run_dir
        yield server


@pytest.fixture(scope="module")
def lab_runs(chromium, lab_server, request):
    """RUN_WHOLE run from the UI, the others opened with their stored outputs, in order."""
    if not NOTEBOOKS:
        pytest.skip(f"no notebooks in {NOTEBOOK_DIR}")
    run_dir = lab_server.run_dir
    _say(request, f"browser run folder (screenshots, records): {run_dir}")
    runs = {}
    t0 = time.monotonic()
    page = chromium.new_page()
    try:
        for nb in NOTEBOOKS:
            shot = run_dir / lb.screenshot_name(nb)
            if _whole(nb):
                r = lb.run_notebook_safely(page, lab_server, nb.name, timeout=TIMEOUT_S, screenshot=shot)
            else:
                r = lb.open_notebook_safely(page, lab_server, nb.name, screenshot=shot)
            lab_server.shutdown_kernels()
            runs[nb.name] = r
            _say(request, f"  {nb.name} ({'run' if _whole(nb) else 'opened'}): {r.seconds:.1f} s, "
                          f"{r.numbered}/{r.expected} cells, "
                          f"{len(r.errors)} errors, {len(r.warnings)} stderr, {r.plots} plots")
    finally:
        page.close()
        (run_dir / "browser.json").write_text(json.dumps(
            {"total_s": round(time.monotonic() - t0, 1),
             "notebooks": [r.summary() for r in runs.values()]}, indent=1))
        if any(not r.done for r in runs.values()):
            shutil.copy(lab_server.log_path, run_dir / "jupyter-lab.log")
    _say(request, f"browser: {len(runs)} notebooks in {time.monotonic() - t0:.0f} s -> {run_dir}", end="\n")
    return runs


def _clip(texts, n=1500) -> str:
    return "\n---\n".join(t[-n:] for t in texts)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab(lab_runs, nb):
    r = lab_runs[nb.name]
    where = f"(screenshot: {r.screenshot})"
    assert r.failure is None, f"{nb.name}: {r.failure} {where}"
    assert r.dialog is None, f"{nb.name}: a dialog blocked the run: {r.dialog!r} {where}"
    assert not r.errors, f"{nb.name} shows an error output {where}:\n{_clip(r.errors)}"
    assert not r.widget_errors, f"{nb.name}: widgets did not display {where}: {r.widget_errors}"
    assert r.numbered == r.expected, f"{nb.name}: {r.numbered} of {r.expected} code cells ran {where}"
    if lb.plots_expected(nb):
        assert r.plots >= 1, f"{nb.name} plots, but no PNG plot rendered {where}: sizes {r.images}"


def test_checks_catch_an_exception_and_pass_a_warning(chromium, lab_server):
    """The same checks on a notebook that warns, plots, then raises: the traceback is seen as an
    error, the warning is not, the plot is counted, and Run All stopped at the exception."""
    page = chromium.new_page()
    try:
        r = lb.run_notebook_in_lab(page, lab_server, SELFCHECK, timeout=120)
    finally:
        page.close()
        lab_server.shutdown_kernels()
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


def test_jupyterlab_at_repo_root_lists_notebooks_in_order(request, tmp_path, chromium_or_reason):
    """``jupyter lab`` at the repository root: notebooks/ lists 00_... to NN_... in order, each
    with a kernel the server has; in Chromium (where there is one) the file browser shows that order."""
    on_disk = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    if not on_disk:
        pytest.skip(f"no notebooks in {NOTEBOOK_DIR}")
    with lb.LabServer(REPO, state_dir=tmp_path / "state") as server:
        listing = server.api("/api/contents/notebooks")
        names = sorted(i["name"] for i in listing["content"] if i["type"] == "notebook")
        assert names == on_disk
        prefixes = [re.match(r"(\d\d)_", n) for n in names]
        assert all(prefixes), f"every notebook name starts with a two-digit step: {names}"
        assert [int(m.group(1)) for m in prefixes] == list(range(len(names))), names
        specs = server.api("/api/kernelspecs")["kernelspecs"]
        for n in names:
            meta = json.loads((NOTEBOOK_DIR / n).read_text(encoding="utf-8"))["metadata"]
            ks = meta.get("kernelspec", {}).get("name")
            assert ks in specs, f"{n}: kernelspec {ks!r} is not one of the server's {sorted(specs)}"

        browser, reason = chromium_or_reason
        if browser is None:
            _say(request, f"file-browser order not checked in Chromium: {reason}")
            return
        page = browser.new_page()
        try:
            page.goto(f"{server.url}/lab/tree/notebooks?reset", wait_until="domcontentloaded")
            page.wait_for_function(
                "n => [...document.querySelectorAll('.jp-DirListing-item .jp-DirListing-itemText')]"
                ".filter(e => e.textContent.endsWith('.ipynb')).length >= n", arg=len(names), timeout=60_000)
            shown = [t for t in page.locator(".jp-DirListing-item .jp-DirListing-itemText").all_text_contents()
                     if t.endswith(".ipynb")]
            assert shown == names, f"the file browser shows {shown}"
        finally:
            page.close()
