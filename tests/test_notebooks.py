"""The notebooks: as committed under nbval, and run by `labkit run` with other parameters into a
temporary folder, asserting on what they recorded (papermill-in-pytest)."""

import json

import nbformat
import pytest

from labkit import runner

TOL_DEQUANT = 4e-3  # bf16 output against the float64 oracle (see test_paths.py)


def test_committed_notebooks_are_clean():
    for path in runner.notebooks():
        nb = nbformat.read(path, as_version=4)
        assert nb.metadata.kernelspec.name == "python3", path.name
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert not any(c.outputs or c.execution_count for c in code), f"{path.name}: strip outputs"
        assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1, path.name


@pytest.mark.notebooks
def test_notebooks_as_committed_pass_nbval(nbval_result):
    """`pytest --nbval-lax notebooks/` at the committed defaults (conftest starts it in the background)."""
    code, tail, run_dir = nbval_result
    assert code == 0, tail
    assert len(list(run_dir.glob("*.parquet"))) >= 5


@pytest.fixture
def run(notebook_run):
    """The notebooks run by `labkit run` at conftest's NOTEBOOK_OVERRIDES (shared with the browser test)."""
    return notebook_run


def _file(df, name):
    return df[df.file == name]


@pytest.mark.notebooks
def test_run_folder_holds_notebooks_records_figures_and_report(run):
    run_dir, df = run
    assert run_dir.name.endswith("-cpu")
    for nb in runner.notebooks():
        assert (run_dir / nb.name).exists()
    assert (run_dir / "04_report.html").read_text().count("<img") >= 3
    for fig in ("01_step_profile", "02_speedup_vs_batch", "03_roofline_heads", "04_tok_s", "05_tok_s", "04_dsa_tok_s"):
        assert (run_dir / f"{fig}.png").exists() and (run_dir / f"{fig}.svg").exists()
    measured = df[df.file != "04_step_model"]
    assert (measured.page_size == 32).all() and (measured.env_device == "cpu").all()


@pytest.mark.notebooks
def test_00_setup_records_ceilings_and_memory(run):
    setup = _file(run[1], "00_setup").set_index("path")
    assert (setup.copy_gbps > 0).all() and (setup.matmul_tflops > 0).all()
    mem = setup.predicted_extra_bytes
    assert mem.full_pool_cast > mem.gather_cast > mem.fp8_native


@pytest.mark.notebooks
def test_01_cast_share_lies_in_0_1_and_grows_with_the_pool(run):
    prof = _file(run[1], "01_step_profile").set_index("category")
    assert 0 < prof.share["cast"] < 1 and prof.heads.iloc[0] == 8
    sweep = _file(run[1], "01_cast_share_sweep").sort_values("pool_tokens")
    assert list(sweep.pool_tokens) == [1024, 32768] and sweep.tokens_read.nunique() == 1  # same attention work
    assert ((0 < sweep.cast_share) & (sweep.cast_share < 1)).all()
    assert sweep.cast_share.iloc[-1] > sweep.cast_share.iloc[0] and sweep.cast_ms.iloc[-1] > sweep.cast_ms.iloc[0]


@pytest.mark.notebooks
def test_02_gather_output_equals_the_full_cast(run):
    out = _file(run[1], "02_outputs")
    assert list(out.path) == ["full_pool_cast", "gather_cast"] and out.bitwise_equal_to_first.all()
    assert (out.rel_err < TOL_DEQUANT).all()
    t = _file(run[1], "02_timings")
    assert set(t.experiment) == {"step", "pool_sweep", "batch_sweep"}
    big = t[(t.experiment == "pool_sweep") & (t.pool_tokens == 32768)].set_index("path").median_ms
    assert big.gather_cast < big.full_pool_cast  # 465 tokens read of 32768
    assert t[t.experiment == "batch_sweep"].read_fraction.max() == pytest.approx(4 * 465 / 4096)


@pytest.mark.notebooks
def test_03_fp8_native_matches_the_oracle_and_refuses_clearly(run):
    paths = _file(run[1], "03_paths").set_index("path")
    assert list(paths.index) == ["full_pool_cast", "gather_cast", "fp8_native", "bf16_pool"]
    assert (paths.rel_err < TOL_DEQUANT).all()
    assert paths.bytes.fp8_native < paths.bytes.gather_cast < paths.bytes.full_pool_cast
    heads = _file(run[1], "03_sweeps").query("experiment == 'heads_sweep' and path == 'fp8_native'")
    assert list(heads.heads) == [4, 64] and heads.intensity.is_monotonic_increasing
    nb = nbformat.read(run[0] / "03_fp8_native_backends.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "refused before launch" in text and "takes KV dtypes ['bf16']" in text


@pytest.mark.notebooks
def test_03_reports_the_minimum_over_its_records_as_the_fastest_fp8_native(run):
    import re

    recs = run[1][run[1].file.isin(["03_paths", "03_peers"])]
    ours = recs[(recs.path == "fp8_native") & (recs.impl != "flashinfer")]
    best = ours.iloc[int(ours.device_ms.to_numpy().argmin())]
    nb = nbformat.read(run[0] / "03_fp8_native_backends.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    name, us = re.search(r"fastest FP8-native here: (\S+), ([\d,.]+) us", text).groups()
    assert name == best.backend and float(us.replace(",", "")) == pytest.approx(best.device_ms * 1e3, abs=0.05)


@pytest.mark.notebooks
def test_04_report_models_the_step_for_three_paths(run):
    steps = _file(run[1], "04_step_model")
    assert list(steps.path) == ["full_pool_cast", "gather_cast", "fp8_native"]
    assert steps.layers.eq(4).all() and steps.tok_s.notna().all()
    assert "Decode step and tokens per second" in (run[0] / "04_report.html").read_text()


@pytest.mark.notebooks
def test_05_sparse_step_profiled_checked_and_modelled(run):
    df = run[1]
    for backend, g in _file(df, "05_step_profile").groupby("backend"):
        t = g.set_index("category").device_ms
        assert t.drop("total").sum() == pytest.approx(t["total"]) and t["index"] > 0 and t["topk"] > 0, backend
    paths = _file(df, "05_paths")
    assert set(paths.path) == {"full_pool_cast", "gather_cast", "fp8_native", "bf16_pool"}
    for p in paths.path.unique():  # each path's profiled step, as a Chrome trace beside the records
        assert json.loads((run[0] / f"05_step_trace_{p}.json").read_text())["traceEvents"], p
    assert (paths.rel_err < TOL_DEQUANT).all()
    sparse, dense = paths[paths["mode"] == "sparse"], paths[paths["mode"] == "dense"]
    assert (sparse.topk == 256).all() and (dense.topk == 0).all()  # tiny's top-256
    assert (sparse.tokens_read == 100 + 256 + 65).all() and (dense.tokens_read == 465).all()
    cast = _file(df, "05_cast").iloc[0]
    assert cast.pool_tokens == 4096 and cast.bytes_ratio == pytest.approx(4096 * (576 + 1152) / (421 * 1152))
    sweep = _file(df, "05_context_sweep")
    assert sorted(sweep.context_len.unique()) == [64, 300] and (sweep.groupby("context_len").cast_bytes.nunique() == 1).all()
    assert sweep.tok_s.gt(0).all() and (sweep.step_ms > sweep.total_ms * 3).all()  # 3 sparse layers of tiny's 4
    steps = _file(df, "05_step_model").set_index("path")
    assert (steps.layers == 4).all() and (steps.dense_layers == 1).all() and steps.tok_s.gt(0).all()
    assert steps.cast_share.full_pool_cast > 0 and steps.cast_share.fp8_native == 0
    assert "Step 4: GLM-5" in (run[0] / "04_report.html").read_text()
