"""Fixtures the test files share."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

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


def _waits_on_a_child(item) -> bool:
    return item.name == NBVAL_TEST or "notebook_run" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """Tests that wait on the background runs go last, in their order: the rest run meanwhile."""
    items[:] = [i for i in items if not _waits_on_a_child(i)] + [i for i in items if _waits_on_a_child(i)]


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


def pytest_sessionfinish(session):
    for c in _children.values():
        if c["proc"].poll() is None:
            c["proc"].kill()
            c["proc"].wait()
        c["tmp"].cleanup()


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
