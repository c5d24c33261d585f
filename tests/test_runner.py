"""`labkit run`: parameters checked before any work, profiles, notebook selection, failures, a run
killed (SIGKILL) or interrupted (Ctrl-C)."""
import ast
import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import papermill as pm
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from labkit import cli, config, profiles, profiling, results, runner


def run_cli(capsys, *argv):
    code = cli.main(["run", *argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize("argv, names", [
    (["-p", "page_size", "3"], ["page_size", "power of two"]),
    (["-p", "pool_tokens", "-5"], ["pool_tokens", "positive"]),
    (["-p", "pool_tokens", "1000"], ["pool_tokens", "multiple of page_size"]),
    (["-p", "kv_dtype", "fp4"], ["kv_dtype", "fp8_e4m3"]),
    (["-p", "tp_size", "3"], ["tp_size", "allowed: [1, 2, 4, 8, 16]"]),
    (["-p", "impl", "cuda"], ["impl", "triton"]),
    (["-p", "heads_sweep", "[8, 256]"], ["heads_sweep", "up to 128"]),
    (["-p", "batch_sweep", "[1, 99]"], ["batch_sweep", "allowed 1.."]),
    (["-p", "pool_sweep", "[100]"], ["pool_sweep", "multiples of page_size"]),
    (["-p", "context_lens", "uniform:9:1"], ["context_lens", "LOW <= HIGH"]),
    (["-p", "colour", "red"], ["colour", "allowed", "pool_tokens"]),
    (["-p", "run_dir", "/tmp/x"], ["run_dir", "set by labkit run"]),
    (["--profile", "gpu-huge"], ["gpu-huge", "cpu-small", "gpu-seed"]),
    (["07"], ["07", "allowed", "01"]),
])
def test_bad_input_is_one_line_naming_it_exit_2_and_no_run_folder(capsys, tmp_path, argv, names):
    out = tmp_path / "runs"
    code, cap = run_cli(capsys, *argv, "--out", str(out))
    assert code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labkit run: error: "), cap.err
    for word in names:
        assert word in lines[0], (word, lines[0])
    assert not out.exists()


def _console_script(job):
    """The installed ``labkit`` given a bad page size (a ``background`` scenario: a process to wait on)."""
    exe = runner.NOTEBOOKS_DIR.parent / ".venv" / "bin" / "labkit"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "labkit.cli"]
    r = subprocess.run(cmd + ["run", "-p", "page_size", "3", "--out", str(job.tmp / "runs")],
                       capture_output=True, text=True, timeout=120)
    return r, job.tmp / "runs"


@pytest.mark.background.with_args(_console_script)
def test_console_script_exit_code(background):
    r, runs = background(_console_script)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "page_size" in r.stderr
    assert not runs.exists()


def test_values_parse_as_yaml_literals():
    assert cli.parse_value("8") == 8
    assert cli.parse_value("null") is None
    assert cli.parse_value("[1, 2]") == [1, 2]
    assert cli.parse_value("uniform:64:512") == "uniform:64:512"
    assert cli.parse_value("fp8_e4m3") == "fp8_e4m3"


@pytest.mark.parametrize("name", sorted(profiles.PROFILES))
def test_profiles_validate(monkeypatch, name):
    monkeypatch.setattr(config, "_device_memory_bytes", lambda device: None)  # GPU pools on a CPU host
    params = profiles.resolve(name)
    assert set(params) == set(profiles.DEFAULTS)


def test_gpu_seed_is_the_study_scale(monkeypatch):
    monkeypatch.setattr(config, "_device_memory_bytes", lambda device: None)
    p = profiles.check(profiles.resolve("gpu-seed"))
    assert (p.model, p.layers, p.heads) == ("glm5", 78, 16)
    assert p.pool_tokens % p.page_size == 0 and abs(p.pool_tokens - 495_000) < p.page_size
    assert p.lens == [8192]


def test_default_profile_follows_the_device():
    assert profiles.default_profile("cpu") == "cpu-small"
    assert runner.plan().profile == profiles.default_profile()


def test_notebook_parameter_cells_hold_the_defaults():
    for nb in runner.notebooks():
        declared = pm.inspect_notebook(str(nb))
        cell = next(c for c in nbformat.read(nb, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
        assigned = {t.id for node in ast.parse(cell.source).body for t in node.targets}
        assert set(declared) == assigned, f"{nb.name}: papermill cannot read {assigned - set(declared)}"
        assert set(declared) <= set(profiles.DEFAULTS), nb.name
        for name, spec in declared.items():
            assert ast.literal_eval(spec["default"]) == profiles.DEFAULTS[name], (nb.name, name)


def test_select_by_number_or_name_in_order():
    stems = [nb.stem for nb in runner.select(["03", "01_profile_full_pool_cast", "01"])]
    assert stems == ["01_profile_full_pool_cast", "03_fp8_native_backends"]
    assert [nb.stem[:2] for nb in runner.select()] == ["00", "01", "02", "03", "05", "04"]  # the report last
    assert [nb.stem[:2] for nb in runner.select(["04", "05"])] == ["05", "04"]


def test_dry_run_prints_the_plan(capsys, tmp_path):
    code, cap = run_cli(capsys, "02", "--dry-run", "-p", "pool_tokens", "32768", "--out", str(tmp_path / "r"))
    plan = json.loads(cap.out)
    assert code == 0 and plan["notebooks"] == ["02_gather_then_cast"] and plan["params"]["pool_tokens"] == 32768
    assert not (tmp_path / "r").exists()


def _notebook(path, *sources):
    cells = [new_code_cell("run_dir = None\nx = 1", metadata={"tags": ["parameters"]})]
    cells += [new_code_cell(s) for s in sources]
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                       "language": "python"}}), path)


def test_a_failing_notebook_stops_the_run_naming_notebook_and_cell(monkeypatch, capsys, tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "00_ok.ipynb", "open(f'{run_dir}/ok.txt', 'w').write('ok')")
    _notebook(nbs / "01_bad.ipynb", "y = x + 1", "raise ValueError('pool exhausted')", "z = 3")
    _notebook(nbs / "02_never.ipynb", "open(f'{run_dir}/never.txt', 'w').write('no')")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", nbs)
    code, cap = run_cli(capsys, "--out", str(tmp_path / "runs"), "--no-progress")
    assert code == 1
    line = cap.err.strip().splitlines()[-1]
    assert "01_bad.ipynb failed in cell 4 (In [4]: `raise ValueError" in line and "pool exhausted" in line
    (failed,) = (tmp_path / "runs").iterdir()
    assert failed.name.endswith("-cpu-failed")
    assert (failed / "ok.txt").exists() and not (failed / "never.txt").exists()
    partial = nbformat.read(failed / "01_bad.ipynb", as_version=4)
    assert any(o.get("ename") == "ValueError" for c in partial.cells for o in c.get("outputs", []))
    assert (failed / "params.json").exists() and (failed / "kernels.log").exists()
    assert not (failed / results.FINISHED).exists()


# -- runs killed or interrupted: a real `labkit run` on the CPU in its own process group ------------
SMALL = ["--profile", "cpu-small", "-p", "pool_sweep", "[8192]", "--no-progress"]


def _start(tmp_path, *argv):
    exe = runner.NOTEBOOKS_DIR.parent / ".venv" / "bin" / "labkit"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "labkit.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("LABKIT_RUN_DIR", results.ACTIVE_RUN_ENV)}
    return subprocess.Popen(cmd + ["run", *argv, "--out", str(tmp_path / "runs")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _wait_for(proc, pattern, runs, timeout=400):
    deadline = time.monotonic() + timeout
    while not list(runs.glob(pattern)):
        if proc.poll() is not None:
            pytest.fail(f"labkit run ended (exit {proc.returncode}) before {pattern}: {proc.communicate()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {pattern} after {timeout} s")
        time.sleep(0.2)


# Both runs are ``background`` scenarios (tests/conftest.py): they run in its thread from the session's
# first test on, mostly waiting on their kernels, while the rest of the suite runs.
def _killed(job):
    """01 and 02, killed once 01 has written a record, then the report (papermill) on what the run
    left: (the run's folder, the executed report)."""
    runs = job.tmp / "runs"
    proc = _start(job.tmp, "01", "02", *SMALL)
    _wait_for(proc, "*/*.parquet", runs)  # 01 has written a record
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its kernel, as an out-of-memory kill or a lost machine
    proc.wait(timeout=60)
    (folder,) = runs.iterdir()
    out = job.tmp / "04_report.ipynb"
    env = {k: v for k, v in os.environ.items() if k not in ("LABKIT_RUN_DIR", results.ACTIVE_RUN_ENV)}
    r = subprocess.run([sys.executable, "-m", "papermill", str(runner.NOTEBOOKS_DIR / "04_report.ipynb"), str(out),
                        "-k", "python3", "-p", "run_dir", str(folder), "--cwd", str(runner.NOTEBOOKS_DIR),
                        "--no-progress-bar"], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.fail(f"papermill 04_report.ipynb on {folder} failed:\n{r.stderr[-3000:]}")
    return folder, out


@pytest.mark.notebooks
@pytest.mark.background.with_args(_killed)
def test_sigkill_leaves_a_folder_that_load_runs_and_the_report_call_partial(background):
    folder, out = background(_killed)
    assert not (folder / results.FINISHED).exists()
    trace = json.loads((folder / "01_step_trace.json").read_text())  # notebook 01's profiled step
    assert any(e.get("name") == profiling.STEP_RANGE for e in trace["traceEvents"])
    df = results.load_runs(folder)
    assert len(df) and not df.run_finished.any() and set(df.run_state) == {"partial"}
    outputs = [o for c in nbformat.read(out, as_version=4).cells for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert f"partial: 1 run(s) never finished (killed, failed or still running), their records are labelled " \
           f"'(partial)': {folder.name}\n" in printed, printed
    tables = "".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert f"{folder.name} (partial)" in tables


def _interrupted(job):
    """01, interrupted 2 s after papermill started it: (exit code, stderr, runs folder)."""
    runs = job.tmp / "runs"
    proc = _start(job.tmp, "01", *SMALL)
    _wait_for(proc, "*/01_*.ipynb", runs)  # papermill has started the notebook
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the run and its kernel
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, runs


@pytest.mark.notebooks
@pytest.mark.background.with_args(_interrupted)
def test_ctrl_c_ends_with_one_line_naming_the_failed_folder(background):
    code, err, runs = background(_interrupted)
    assert code == cli.EXIT_INTERRUPTED, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("labkit run: error: interrupted; partial run kept in "), err
    assert lines[-2].startswith("[1/1] 01_"), err  # nothing between the progress line and the verdict
    (folder,) = runs.iterdir()
    assert folder.name.endswith("-cpu-failed") and str(folder) in lines[-1]
    assert (folder / "params.json").exists() and not (folder / results.FINISHED).exists()
    assert set(results.load_runs(folder).run_state) <= {"partial"}


# -- the HTML report where nbconvert came as wheels installed with `pip install --target SITE` -----
def _fake_layout(root, templates_at):
    """An nbconvert package at root/site/nbconvert and, when given, its templates under templates_at."""
    pkg = root / "site" / "nbconvert"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if templates_at is not None:
        (root / templates_at / "share/jupyter/nbconvert/templates/lab").mkdir(parents=True)
    return pkg / "__init__.py"


@pytest.mark.parametrize("templates_at, expected", [
    ("site", "site"),  # pip install --target SITE: SITE/share/jupyter
    (None, None),  # no templates anywhere near: nothing added
])
def test_template_dirs_next_to_a_target_install(tmp_path, templates_at, expected):
    found = runner.template_dirs(str(_fake_layout(tmp_path, templates_at)))
    want = [tmp_path / expected / "share/jupyter/nbconvert/templates"] if expected else []
    assert found == [p.resolve() for p in want]


def test_template_dirs_of_a_prefix_install(tmp_path):
    """PREFIX/lib/python3.X/site-packages/nbconvert with its templates in PREFIX/share/jupyter."""
    pkg = tmp_path / "prefix/lib/python3.12/site-packages/nbconvert"
    pkg.mkdir(parents=True)
    (tmp_path / "prefix/share/jupyter/nbconvert/templates/lab").mkdir(parents=True)
    found = runner.template_dirs(str(pkg / "__init__.py"))
    assert found == [(tmp_path / "prefix/share/jupyter/nbconvert/templates").resolve()]


def test_export_html_finds_the_templates_of_a_target_install(tmp_path, monkeypatch):
    """Jupyter's data path holds no templates (the offline GPU machine); the exporter finds them beside
    the nbconvert package, as `pip install --target` lays them out."""
    import shutil

    import nbconvert
    from nbconvert import HTMLExporter
    from nbconvert.exporters import templateexporter

    real = runner.template_dirs()[0]
    fake = _fake_layout(tmp_path, None)
    shutil.copytree(real, tmp_path / "site/share/jupyter/nbconvert/templates")
    def data_path(*sub):  # Jupyter's data path as on that machine: $JUPYTER_PATH only, no install prefix
        roots = [r for r in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if r] or [str(tmp_path / "empty")]
        return [os.path.join(r, *sub) for r in roots]

    monkeypatch.setattr(templateexporter, "jupyter_path", data_path)
    # and the template roots nbconvert read at import time: none there either ("base/null.j2")
    trait = templateexporter.TemplateExporter.class_traits()["template_data_paths"]
    monkeypatch.setattr(trait, "default_value", [str(tmp_path / "empty")])
    monkeypatch.setattr(nbconvert, "__file__", str(fake))
    nb = tmp_path / "run" / "04_report.ipynb"
    nb.parent.mkdir()
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1", outputs=[nbformat.v4.new_output(
        "stream", text="the report figure\n")])]), nb)
    with pytest.raises(ValueError, match="No template sub-directory with name 'lab'"):
        HTMLExporter().from_notebook_node(nbformat.read(nb, as_version=4))  # what the machine said
    html = runner.export_html(nb)
    assert html == nb.with_suffix(".html") and "<pre>the report figure" in html.read_text()
    assert "x = 1" not in html.read_text()  # code cells hidden
    assert [p.name for p in nb.parent.iterdir() if p.name.startswith(".")] == []  # written atomically
