"""Fixtures the test files share."""
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
def notebook_run(tmp_path_factory):
    """(run folder, its records): every notebook run once by `labkit run` into a temporary folder.
    tests/test_notebooks.py asserts on the records; tests/test_browser.py opens the executed notebooks."""
    from labkit import results, runner

    plan = runner.plan(profile="cpu-small", overrides=NOTEBOOK_OVERRIDES)
    run_dir = runner.execute(plan, base=tmp_path_factory.mktemp("runs"), progress=False, log=lambda msg: None)
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


# -- nbval on the committed notebooks, started in the background as the session begins ------------
# Its notebooks run in a child process on the second core while the rest of the suite runs here;
# tests/test_notebooks.py waits for it and asserts on its result.
NBVAL_TEST = "test_notebooks_as_committed_pass_nbval"
_nbval = {}


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(i.name == NBVAL_TEST for i in session.items):
        return
    from labkit import runner

    tmp = tempfile.TemporaryDirectory(prefix="labkit-nbval-")
    run_dir, log = Path(tmp.name) / "run", Path(tmp.name) / "nbval.log"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # inline figures, as in Jupyter
    env["LABKIT_RUN_DIR"] = str(run_dir)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider",
                                 "-p", "no:randomly", str(runner.NOTEBOOKS_DIR)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    _nbval.update(tmp=tmp, proc=proc, run_dir=run_dir, log=log)


def pytest_sessionfinish(session):
    if _nbval:
        if _nbval["proc"].poll() is None:
            _nbval["proc"].kill()
            _nbval["proc"].wait()
        _nbval["tmp"].cleanup()


@pytest.fixture
def nbval_result():
    """(exit code, output tail, run folder) of the background nbval run, once it has ended."""
    if not _nbval:
        pytest.fail(f"nbval was not started: pytest_collection_finish starts it when {NBVAL_TEST} is collected")
    try:
        code = _nbval["proc"].wait(timeout=600)
    except subprocess.TimeoutExpired:
        _nbval["proc"].kill()
        code = "timeout (600 s)"
    return code, _nbval["log"].read_text()[-4000:], _nbval["run_dir"]
