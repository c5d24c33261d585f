"""JupyterLab in headless Chromium: start a local server, run notebooks from the UI, take screenshots.

Used by ``tests/test_browser.py``; also runs on its own::

    python tests/browser.py notebooks/*.ipynb        # runs each from the UI, prints a summary

Pieces:

- ``find_chromium()``: a Chromium binary (``$LABKIT_CHROMIUM``, ``/usr/bin/chromium``, ``PATH``).
- ``LabServer``: ``jupyter lab`` from this Python's environment on 127.0.0.1, a free port, no token,
  its own root, settings, workspaces and runtime folders (nothing from ``~/.jupyter`` leaks in).
- ``open_browser()``: Playwright driving that Chromium (never ``playwright install``).
- ``run_notebook_in_lab()``: open one notebook, wait for its kernel, menu Run -> Run All Cells, wait
  until done, read the outputs shown (errors, stderr, plots), optionally save a full-page screenshot.
- ``open_notebook_in_lab()``: open an executed notebook without running it and read the same from
  its stored outputs.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/lib/chromium/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]

# JupyterLab user settings for the test server: no news/update pop-up covering the page, every
# cell kept in the DOM (the default windowing drops or skips off-screen cells, which would hide
# prompts, outputs and plots from the checks and from the screenshot), no blank page after the end.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "scrollPastEnd": False},
}

# An stderr output is an error when it holds a traceback or a line like "ValueError: ..." at its
# start; warnings ("file.py:3: UserWarning: ...") and progress bars are stderr too and are allowed.
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(?:\w*Error|\w*Exception|KeyboardInterrupt)\b(?::|$)", re.M)
# Code that draws a figure: matplotlib calls, pandas .plot, or a plotting helper (labkit.plot_*).
_PLOT_CALL = re.compile(r"\bplt\.|\bpyplot\b|\.plot\(|\bplot_\w+\(|\bplots?\.\w+\(|\.imshow\(|\bsubplots\(")


def find_chromium() -> str | None:
    """Path of a Chromium binary, or None: ``$LABKIT_CHROMIUM``, the Debian paths, then ``PATH``."""
    env = os.environ.get("LABKIT_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for cand in CHROMIUM_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def is_error_text(text: str) -> bool:
    """True for the text of a traceback / exception output; False for warnings and other stderr."""
    return "Traceback (most recent call last)" in text or bool(_ERROR_LINE.search(text))


def _code_sources(nb_path) -> list[str]:
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    out = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append("".join(src) if isinstance(src, list) else src)
    return out


def plots_expected(nb_path) -> bool:
    """Whether a notebook's code draws a figure (a matplotlib call or a plotting helper)."""
    return any(_PLOT_CALL.search(src) for src in _code_sources(nb_path))


def runnable_cells(nb_path) -> int:
    """Code cells with a non-blank source: the ones that get an execution number when run."""
    return sum(1 for src in _code_sources(nb_path) if src.strip())


def copy_notebooks(paths, dest, strip_outputs: bool = True) -> list[Path]:
    """Copy notebooks into ``dest``; with ``strip_outputs`` stored outputs and execution counts are
    dropped, so everything the browser shows afterwards comes from the run under test."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copies = []
    for p in map(Path, paths):
        nb = json.loads(p.read_text(encoding="utf-8"))
        if strip_outputs:
            for cell in nb.get("cells", []):
                if cell.get("cell_type") == "code":
                    cell["outputs"] = []
                    cell["execution_count"] = None
        target = dest / p.name
        target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        copies.append(target)
    return copies


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the server ----------------------------------------------------------------------------------
class LabServer:
    """``jupyter lab`` on 127.0.0.1 with ``root_dir`` as its root; a context manager.

    Runs from ``python`` (default: this interpreter, i.e. the project's venv under pytest), so the
    kernels it starts are that environment's ``python3`` kernel. Token off, XSRF off (loopback only),
    and private settings/workspace/config/runtime folders under ``state_dir``. ``MPLBACKEND`` is
    removed from the server's environment so that kernels draw inline, as in a user's JupyterLab;
    ``env`` adds variables for the server and its kernels.
    """

    def __init__(self, root_dir, state_dir=None, python: str | None = None, start_timeout: float = 60.0,
                 env: dict | None = None):
        self.extra_env = dict(env or {})
        self.root_dir = Path(root_dir).resolve()
        self._own_state = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="labkit-lab-"))
        self.python = python or sys.executable
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir / "jupyter-lab.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_settings(self) -> Path:
        settings = self.state_dir / "settings"
        for rel, value in LAB_SETTINGS.items():
            f = settings / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(value), encoding="utf-8")
        return settings

    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)
        for var, sub in (("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTER_CONFIG_DIR", "config"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
            d = self.state_dir / sub
            d.mkdir(parents=True, exist_ok=True)
            env[var] = str(d)
        # the venv's bin first, as if it were activated (the kernel and any `!cmd` find its tools)
        env["PATH"] = str(Path(self.python).parent) + os.pathsep + env.get("PATH", "")
        env.update(self.extra_env)
        return env

    def start(self) -> "LabServer":
        self._write_settings()
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            cmd = [self.python, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1",
                   "--port", str(self.port), "--ServerApp.port_retries=0",
                   "--IdentityProvider.token=", "--ServerApp.password=",
                   "--ServerApp.disable_check_xsrf=True",
                   f"--ServerApp.root_dir={self.root_dir}",
                   f"--LabApp.workspaces_dir={self.state_dir / 'workspaces'}"]
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                cmd.append("--allow-root")
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(cmd, cwd=self.root_dir, env=self._env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            log.close()
            # stopped at exit too: a server started from a thread that is cut short (its own session)
            # would outlive the process
            atexit.register(self.stop)
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"jupyter lab did not start ({self.python} -m jupyterlab); "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/api/status", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def api(self, path: str, method: str = "GET"):
        """JSON from the server's REST API (``/api/...``); None for an empty answer."""
        req = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for k in self.api("/api/kernels") or []:
            with contextlib.suppress(urllib.error.URLError):
                self.api(f"/api/kernels/{k['id']}", method="DELETE")

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL of its process group if it hangs."""
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the group this server leads
                self.proc.wait(timeout=5)
        self.proc = None
        if self._own_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- the browser ---------------------------------------------------------------------------------
class BrowserUnavailable(RuntimeError):
    """Chromium (or Playwright) is not there or does not launch; the message says which."""


@contextlib.contextmanager
def open_browser(executable: str | None = None):
    """Yield a Playwright ``Browser`` on a local Chromium; raises ``BrowserUnavailable`` if it can't."""
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise BrowserUnavailable(f"the Python package 'playwright' is not installed ({e}); "
                                 "pip install -e '.[test]'") from e
    executable = executable or find_chromium()
    if executable is None and os.environ.get("LABKIT_CHROMIUM"):
        raise BrowserUnavailable(f"$LABKIT_CHROMIUM={os.environ['LABKIT_CHROMIUM']} is not an executable")
    if executable is None:
        raise BrowserUnavailable("no Chromium found (looked at $LABKIT_CHROMIUM, "
                                 + ", ".join(CHROMIUM_CANDIDATES)
                                 + ", PATH); install it: apt-get install -y --no-install-recommends chromium")
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        except PlaywrightError as e:
            lines = str(e).strip().splitlines()
            detail = [ln.strip() for ln in lines if "[err]" in ln or "exitCode" in ln][-5:]
            raise BrowserUnavailable(f"Chromium at {executable} does not launch: "
                                     + "; ".join(lines[:1] + detail)) from e
        try:
            yield browser
        finally:
            browser.close()


# -- one notebook, run from the UI ---------------------------------------------------------------
@dataclass
class NotebookRun:
    name: str
    seconds: float = 0.0
    done: bool = False
    numbered: int = 0          # code cells with an execution number after the run
    expected: int = 0          # code cells with a non-blank source
    errors: list[str] = field(default_factory=list)    # error outputs (tracebacks), as shown
    warnings: list[str] = field(default_factory=list)  # other stderr outputs, as shown
    images: list[tuple[int, int]] = field(default_factory=list)  # natural sizes of the PNG plots
    widget_errors: list[str] = field(default_factory=list)
    dialog: str | None = None
    screenshot: str | None = None
    failure: str | None = None  # what went wrong in driving the page (e.g. a timeout), if anything

    @property
    def plots(self) -> int:
        return sum(1 for w, h in self.images if w > 0 and h > 0)

    def summary(self) -> dict:
        d = dict(self.__dict__)
        d["plots"] = self.plots
        return d


_STATE_JS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return null;
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim());
  const stderr = [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
      .map(e => e.innerText);
  const imgs = [...panel.querySelectorAll('[data-mime-type="image/png"] img')]
      .map(i => [i.complete ? i.naturalWidth : 0, i.complete ? i.naturalHeight : 0]);
  const widgetErrors = [...panel.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText)
      .filter(t => t.includes('Error displaying widget'));
  const bar = document.querySelector('#jp-main-statusbar');
  const dialog = document.querySelector('.jp-Dialog');
  return {prompts, stderr, imgs, widgetErrors, status: bar ? bar.innerText : '',
          dialog: dialog ? dialog.innerText : null};
}"""

_SCROLLER_JS = """() => {
  // the element that scrolls the notebook (.jp-WindowedPanel-outer in JupyterLab 4): the one in
  // the visible panel with the most hidden height; scrolled back to the top
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return [0, 0];
  let best = null;
  for (const e of panel.querySelectorAll('*')) {
    if (!best || e.scrollHeight - e.clientHeight > best.scrollHeight - best.clientHeight) best = e;
  }
  if (!best) return [0, 0];
  best.scrollTop = 0;
  return [best.scrollHeight, best.clientHeight];
}"""


def _state(page) -> dict | None:
    return page.evaluate(_STATE_JS)


def _wait(page, cond, timeout: float, what: str, poll: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = _state(page)
        if last is not None and cond(last):
            return last
        page.wait_for_timeout(poll * 1000)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last state: "
                       f"{json.dumps(last)[:1500] if last else None}")


def _kernel_idle(st) -> bool:
    return "| Idle" in st["status"]


def run_notebook_in_lab(page, server: LabServer, rel_path: str, timeout: float = 600.0,
                        screenshot: str | os.PathLike | None = None, width: int = 1280,
                        max_height: int = 16000) -> NotebookRun:
    """Open ``rel_path`` (relative to the server root), Run -> Run All Cells, wait, read the outputs.

    Done means: no prompt shows ``*``, the status bar reads Idle, and either every non-blank code
    cell has an execution number or an error is shown (Run All stops at the first exception).
    A kernel dialog (e.g. a missing kernelspec) ends the wait and is reported in ``dialog``.
    """
    local = server.root_dir / rel_path
    run = NotebookRun(name=rel_path, expected=runnable_cells(local))
    page.set_viewport_size({"width": width, "height": 900})
    url = f"{server.url}/lab/tree/{urllib.parse.quote(rel_path)}?reset"
    page.goto(url, wait_until="domcontentloaded")
    st = _wait(page, lambda s: _kernel_idle(s) or s["dialog"], 120, f"the kernel of {rel_path} to be idle")
    if st["dialog"]:
        run.dialog = st["dialog"]
        return run
    t0 = time.monotonic()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

    def done(s) -> bool:
        if s["dialog"]:
            return True
        if any("*" in p for p in s["prompts"]) or not _kernel_idle(s):
            return False
        numbered = sum(1 for p in s["prompts"] if re.search(r"\[\d+\]", p))
        return numbered >= run.expected or any(is_error_text(t) for t in s["stderr"])

    _wait(page, done, timeout, f"Run All Cells of {rel_path} to finish")
    page.wait_for_timeout(500)  # let the last outputs and images settle, then check it still holds
    st = _wait(page, done, timeout, f"Run All Cells of {rel_path} to finish")
    run.seconds = time.monotonic() - t0
    return _read_outputs(page, run, st, screenshot, width, max_height)


def open_notebook_in_lab(page, server: LabServer, rel_path: str, timeout: float = 120.0,
                         screenshot: str | os.PathLike | None = None, width: int = 1280,
                         max_height: int = 16000) -> NotebookRun:
    """Open ``rel_path`` (an executed notebook) without running it and read what it shows from its
    stored outputs: execution numbers, errors, stderr and plots, as ``run_notebook_in_lab`` does."""
    local = server.root_dir / rel_path
    run = NotebookRun(name=rel_path, expected=runnable_cells(local))
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{server.url}/lab/tree/{urllib.parse.quote(rel_path)}?reset", wait_until="domcontentloaded")
    t0 = time.monotonic()

    def shown(s) -> bool:  # every stored prompt rendered and the kernel up (or a dialog)
        numbered = sum(1 for p in s["prompts"] if re.search(r"\[\d+\]", p))
        return bool(s["dialog"]) or (_kernel_idle(s) and numbered >= run.expected)

    try:
        st = _wait(page, shown, timeout, f"{rel_path} to render its stored outputs")
    except TimeoutError:
        st = _state(page)  # read what is there: the checks name what is missing
    run.seconds = time.monotonic() - t0
    return _read_outputs(page, run, st, screenshot, width, max_height)


def _read_outputs(page, run: NotebookRun, st: dict, screenshot, width: int, max_height: int) -> NotebookRun:
    run.done = True
    run.dialog = st["dialog"]
    # images load from data: URLs; give them a moment to decode before reading their sizes
    with contextlib.suppress(TimeoutError):
        _wait(page, lambda s: all(w > 0 for w, _ in s["imgs"]), 10, "plots to decode")
    st = _state(page)
    run.numbered = sum(1 for p in st["prompts"] if re.search(r"\[\d+\]", p))
    run.errors = [t for t in st["stderr"] if is_error_text(t)]
    run.warnings = [t for t in st["stderr"] if not is_error_text(t)]
    run.images = [tuple(x) for x in st["imgs"]]
    run.widget_errors = st["widgetErrors"]
    if screenshot is not None:
        run.screenshot = str(full_notebook_screenshot(page, screenshot, width, max_height))
    return run


def full_notebook_screenshot(page, path, width: int = 1280, max_height: int = 16000) -> Path:
    """The notebook scrolls inside its panel, so grow the viewport to its full height, then shoot."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": width, "height": 900})
    page.keyboard.press("Escape")  # command mode: Ctrl+B below is not a cell edit
    page.keyboard.press("Control+b")  # hide the left sidebar: the notebook gets the full width
    page.wait_for_timeout(200)
    scroll_h, client_h = page.evaluate(_SCROLLER_JS)
    height = min(max_height, 900 + max(0, scroll_h - client_h) + 40)
    page.set_viewport_size({"width": width, "height": int(height)})
    page.wait_for_timeout(300)
    page.evaluate(_SCROLLER_JS)  # back to the top once more, after the resize
    page.wait_for_timeout(300)
    page.screenshot(path=str(path), full_page=False)
    page.set_viewport_size({"width": width, "height": 900})
    return path


def screenshot_name(nb_path) -> str:
    return f"screenshot-{Path(nb_path).stem}.png"


def run_notebook_safely(page, server: LabServer, rel_path: str, timeout: float = 600.0,
                        screenshot=None, **kw) -> NotebookRun:
    """``run_notebook_in_lab``, but a failure to drive the page (a timeout, a crash) comes back as
    ``failure`` with a screenshot of the page as it was, instead of an exception."""
    return _safely(run_notebook_in_lab, page, server, rel_path, timeout=timeout, screenshot=screenshot, **kw)


def open_notebook_safely(page, server: LabServer, rel_path: str, screenshot=None, **kw) -> NotebookRun:
    """``open_notebook_in_lab``, a failure to drive the page coming back as ``failure``."""
    return _safely(open_notebook_in_lab, page, server, rel_path, screenshot=screenshot, **kw)


def _safely(fn, page, server, rel_path, screenshot=None, **kw) -> NotebookRun:
    try:
        return fn(page, server, rel_path, screenshot=screenshot, **kw)
    except Exception as e:  # noqa: BLE001  (reported, with the page as it was)
        run = NotebookRun(name=rel_path, failure=f"{type(e).__name__}: {e}")
        if screenshot is not None:
            with contextlib.suppress(Exception):
                run.screenshot = str(full_notebook_screenshot(page, screenshot))
        return run


def run_notebooks(paths, out_dir=None, timeout: float = 600.0, log=print, env=None) -> list[NotebookRun]:
    """Copy ``paths`` to a temporary root, start one server and one browser, run each notebook in
    turn (kernel shut down after each), screenshots into ``out_dir`` when given; ``env``: extra
    variables for the kernels."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="labkit-browser-") as tmp:
        root = Path(tmp) / "root"
        copies = copy_notebooks(paths, root)
        with LabServer(root, state_dir=Path(tmp) / "state", env=env) as server, open_browser() as browser:
            page = browser.new_page()
            for nb in copies:
                shot = Path(out_dir) / screenshot_name(nb) if out_dir else None
                r = run_notebook_safely(page, server, nb.name, timeout=timeout, screenshot=shot)
                server.shutdown_kernels()
                log(f"{nb.name}: {r.seconds:.1f} s, {r.numbered}/{r.expected} cells, "
                    f"{len(r.errors)} errors, {len(r.warnings)} stderr, {r.plots} plots")
                runs.append(r)
    return runs


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--out", help="folder for screenshots (default: a new data/runs/<time>-browser)")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    if a.out is None:
        from labkit.results import new_run_dir
        a.out = str(new_run_dir(tag="browser"))
    print(f"screenshots and the notebooks' records (LABKIT_RUN_DIR): {a.out}")
    results = run_notebooks(a.notebooks, a.out, a.timeout, env={"LABKIT_RUN_DIR": str(Path(a.out).resolve())})
    sys.exit(0 if all(r.done and not r.errors and not r.dialog for r in results) else 1)
