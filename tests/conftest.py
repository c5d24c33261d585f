"""Fixtures the test files share."""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# numpy's BLAS (the dots of the Triton interpreter) on one thread, set before numpy loads (here,
# with torch), and inherited by the background runs and their kernels: with two threads, the tests
# ran 1.5-2x slower beside the background runs on two cores, and no faster alone
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# the same examples on every run (CI is reproducible); HYPOTHESIS_PROFILE=explore draws fresh ones
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# `labkit run` for the notebook tests, not at the defaults: an odd batch (uneven, not page
# multiples), 8 heads, page size 32, one layer
NOTEBOOK_OVERRIDES = dict(
    num_layers=1, tp_size=2, pool_tokens=4096, page_size=32, batch_size=3, context_lens=[100, 300, 65],
    warmup_ms=2, rep_ms=10, pool_sweep=[1024, 32768], batch_sweep=[1, 12], heads_sweep=[4, 64],
    context_sweep=[33, 500], sweep_batch=2, sweep_context=200, sparse_contexts=[64, 300], sparse_batch=2)


@pytest.fixture(scope="session")
def notebook_run():
    """(run folder, its records): every notebook run once by `labkit run` (started in the background
    when the session begins) into a temporary folder. tests/test_notebooks.py asserts on the records;
    tests/test_browser.py opens the executed notebooks."""
    return _notebook_run()


def _notebook_run():
    from labkit import results

    code, tail, out = _finished("labkit run")
    assert code == 0, f"labkit run {' '.join(_labkit_run_args())} failed:\n{tail}"
    (run_dir,) = out.iterdir()
    return run_dir, results.load_runs(run_dir)


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating tensor allocated with torch.empty starts as NaN: an unwritten output shows."""
    real = torch.empty

    def nan_empty(*a, **k):
        t = real(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)


# -- the notebook runs, started in the background as the session begins ---------------------------
# Both run their notebooks in child processes (mostly on the second core) while the rest of the
# suite runs here; the fixtures wait for them.
NBVAL_TEST = "test_notebooks_as_committed_pass_nbval"
_children = {}  # name -> dict(tmp, proc, out, log)


def _labkit_run_args() -> list[str]:
    args = ["--profile", "cpu-small", "--no-progress"]
    for name, value in NOTEBOOK_OVERRIDES.items():
        args += ["-p", name, json.dumps(value)]
    return args


def _start(name: str, argv, env: dict) -> None:
    """Start ``argv(out)`` with ``env(out)``: ``out`` is a new temporary folder for what it writes."""
    tmp = tempfile.TemporaryDirectory(prefix="labkit-test-")
    out, log = Path(tmp.name) / "out", Path(tmp.name) / "log.txt"
    out.mkdir()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv(out), env=env(out), stdout=f, stderr=subprocess.STDOUT, text=True)
    _children[name] = dict(tmp=tmp, proc=proc, out=out, log=log)


def _finished(name: str, timeout: float = 900):
    """(exit code, last lines of its output, its output folder) once the child has ended."""
    if name not in _children:
        pytest.fail(f"{name} was not started: pytest_collection_finish starts it when a test needs it")
    c = _children[name]
    try:
        code = c["proc"].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        c["proc"].kill()
        code = f"timeout ({timeout:.0f} s)"
    return code, c["log"].read_text()[-4000:], c["out"]


def _waits(item) -> int:
    """0: waits on nothing; 1: reads a background scenario; 2: waits on `labkit run`; 3: on nbval."""
    if item.name == NBVAL_TEST:
        return 3
    if "notebook_run" in getattr(item, "fixturenames", ()):
        return 2
    return int(item.get_closest_marker("background") is not None)


def pytest_collection_modifyitems(session, config, items):
    """Tests that wait go last, those likely to wait least first (a stable sort): the rest run meanwhile."""
    items.sort(key=_waits)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    from labkit import results, runner

    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "LABKIT_RUN_DIR", results.ACTIVE_RUN_ENV)}
    if any("notebook_run" in getattr(i, "fixturenames", ()) for i in session.items):
        _start("labkit run", lambda out: [sys.executable, "-m", "labkit.cli", "run", *_labkit_run_args(),
                                          "--out", str(out)], lambda out: env)
    if any(i.name == NBVAL_TEST for i in session.items):
        # inline figures, as in Jupyter; records into a temporary folder
        _start("nbval", lambda out: [sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider",
                                     "-p", "no:randomly", str(runner.NOTEBOOKS_DIR)],
               lambda out: {**env, "LABKIT_RUN_DIR": str(out)})
    if _children:
        # their kernels run torch on one thread (labkit.Lab); here too: with three busy processes on
        # two cores, a multi-threaded op waits on a descheduled thread
        torch.set_num_threads(1)


def pytest_sessionfinish(session):
    for c in _children.values():
        if c["proc"].poll() is None:
            c["proc"].kill()
            c["proc"].wait()
        c["tmp"].cleanup()


# -- scenarios in a thread, from the first test on -------------------------------------------------
# A test marked ``@pytest.mark.background.with_args(fn)`` (with_args: ``fn`` is a function) reads
# ``background(fn)``: what ``fn(job)`` returned. The session's scenarios run one after the other,
# in the order of their first tests, in one thread started with the first test: a scenario that
# mostly waits on other processes (a server, a browser, a run to kill) overlaps the rest of the
# suite, and one at a time they add at most one more busy process to the two cores.
_jobs = {}  # fn -> Job
_stop = threading.Event()  # set when the session ends first
_shared = {}  # the scenarios' thread: "stack" (closed when they have run), "browser"


class Job:
    """One scenario, ``fn(job)``. ``tmp``: its temporary folder; ``stop``: set when the session ends
    first; ``executed(name)``: a notebook as `labkit run` executed it; ``browser()``: Chromium."""

    def __init__(self, fn, tmp: Path):
        self.fn, self.tmp, self.stop = fn, tmp, _stop
        self.done = threading.Event()
        self.result = self.error = None

    def run(self) -> None:
        try:
            if self.stop.is_set():
                pytest.fail(f"{self.fn.__name__} did not run: the session ended first")
            self.result = self.fn(self)
        except BaseException as e:  # noqa: BLE001  (raised again in the tests that read it)
            self.error = e
        finally:
            self.done.set()

    def executed(self, name: str):
        """The notebook ``name`` (a file name) as `labkit run` executed it, as soon as it has (the run's
        log says "<stem> done in"; it may still run others), or None if ``stop`` is set first."""
        if "labkit run" not in _children:
            pytest.fail("labkit run was not started: it starts when a test asks for notebook_run")
        c, line = _children["labkit run"], f"{Path(name).stem} done in"
        while True:
            ended = c["proc"].poll() is not None
            if line in c["log"].read_text():
                (run_dir,) = c["out"].iterdir()
                return run_dir / name
            if ended:
                _notebook_run()  # fails, saying why
                pytest.fail(f"labkit run ended without executing {name}")
            if self.stop.wait(0.5):
                return None

    def browser(self):
        """One Playwright browser for all the scenarios (they run in one thread), launched when one
        first asks; raises tests/browser.py's BrowserUnavailable, saying why, where there is none."""
        import browser as lb  # tests/browser.py

        if "browser" not in _shared:
            try:
                _shared["browser"] = _shared["stack"].enter_context(lb.open_browser())
            except lb.BrowserUnavailable as e:
                _shared["browser"] = e
        if isinstance(_shared["browser"], Exception):
            raise _shared["browser"]
        return _shared["browser"]

    def value(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture(scope="session", autouse=True)
def _background_jobs(request, tmp_path_factory):
    fns = dict.fromkeys(m.args[0] for i in request.session.items for m in i.iter_markers("background"))
    jobs = [Job(fn, tmp_path_factory.mktemp(fn.__name__.strip("_"))) for fn in fns]
    _jobs.update((job.fn, job) for job in jobs)

    def run_all():
        with contextlib.ExitStack() as _shared["stack"]:
            for job in jobs:
                job.run()

    worker = threading.Thread(target=run_all, name="background", daemon=True)
    worker.start()
    yield
    _stop.set()
    worker.join(timeout=60)


@pytest.fixture(scope="session")
def background():
    """``background(fn)``: what the scenario ``fn`` returned once it has run (raising what it
    raised); the test that asks is marked ``@pytest.mark.background.with_args(fn)``."""
    def value(fn):
        if fn not in _jobs:
            pytest.fail(f"{fn.__name__} was not started: mark the test @pytest.mark.background.with_args({fn.__name__})")
        return _jobs[fn].value()
    return value


@pytest.fixture
def nbval_result():
    """(exit code, output tail, folder of its records) of `pytest --nbval-lax notebooks/`."""
    return _finished("nbval")


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine a stalled OpenMP barrier dwarfs the ops."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
