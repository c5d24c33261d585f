"""`labkit run`: parameters checked before any work, profiles, notebook selection, failures."""
import ast
import json
import subprocess
import sys

import nbformat
import papermill as pm
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from labkit import cli, config, profiles, runner


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


def test_console_script_exit_code(tmp_path):
    exe = runner.NOTEBOOKS_DIR.parent / ".venv" / "bin" / "labkit"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "labkit.cli"]
    r = subprocess.run(cmd + ["run", "-p", "page_size", "3", "--out", str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "page_size" in r.stderr
    assert not (tmp_path / "runs").exists()


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
