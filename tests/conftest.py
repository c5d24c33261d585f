"""Fixtures the test files share."""
import os

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
