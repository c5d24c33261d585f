"""labkit.results and labkit.plots: records round trip, atomic writes under a crash, no overwrite,
the finished-run marker."""
import json
import os
import re
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from labkit import plots, results  # noqa: E402
from labkit.envinfo import REPO  # noqa: E402

ENV = dict(device="cpu", device_name="CPU", labkit_rev="abc")


def _records(n=3, **over):
    return [results.make_record("fp8_native", "fp8_native.torch", "torch", 1.0 + i, 0.9 + i, 1.1 + i,
                                params=dict(pool_tokens=4096 * (i + 1), context_lens=[100, 200]),
                                device_env=ENV, gbps=10.0 * i, extra_bytes=1000 + i, **over)
            for i in range(n)]


def _leftovers(d):
    return [f for f in os.listdir(d) if f.endswith(".tmp")]


def test_make_record_is_flat():
    r = _records(1)[0]
    assert r["path"] == "fp8_native" and r["median_ms"] == 1.0 and r["pool_tokens"] == 4096
    assert r["context_lens"] == "[100, 200]"  # containers as JSON text: one Parquet column type
    assert r["env_device_name"] == "CPU" and r["gbps"] == 0.0
    assert all(not isinstance(v, (list, dict, tuple)) for v in r.values())


def test_make_record_key_clash():
    with pytest.raises(ValueError, match="'device' given twice"):
        results.make_record("p", "b", "i", 1, 1, 1, params=dict(device="cpu"), device_env={}, device="cuda")
    r = results.make_record("p", "b", "i", 1, 1, 1, params=dict(device="cpu"), device_env={}, device="cpu")
    assert r["device"] == "cpu"


def test_round_trip(tmp_path):
    recs = _records()
    path = results.write_records(tmp_path, recs, "paths")
    assert path == tmp_path / "paths.parquet"
    back = results.load_runs(tmp_path)
    assert set(back.run) == {tmp_path.name} and set(back.file) == {"paths"}
    pd.testing.assert_frame_equal(back.drop(columns=["run", "file", "run_state", "run_finished"]),
                                  pd.DataFrame(recs))


def test_never_overwrites(tmp_path):
    first = results.write_records(tmp_path, _records(1), "paths")
    before = first.read_bytes()
    second = results.write_records(tmp_path, _records(2), "paths")
    third = results.write_records(tmp_path, _records(3), "paths.parquet")
    assert [first.name, second.name, third.name] == ["paths.parquet", "paths-1.parquet", "paths-2.parquet"]
    assert first.read_bytes() == before
    assert len(results.load_runs(tmp_path)) == 1 + 2 + 3


def test_crash_at_publish_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "link", boom)
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        results.write_records(tmp_path, _records(), "paths")
    assert os.listdir(tmp_path) == []


def test_crash_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "notes.txt"
    results.atomic_write_text(target, "old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        results.atomic_write_text(target, "new")
    assert target.read_text() == "old" and _leftovers(tmp_path) == []


def test_writer_dying_midway(tmp_path):
    target = tmp_path / "x.bin"
    results.atomic_write_bytes(target, b"intact")

    def half(tmp):
        tmp.write_bytes(b"PAR1 partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        results.atomic_write_with(target, half)
    with pytest.raises(RuntimeError):
        results.atomic_write_with(tmp_path / "y.parquet", half, overwrite=False)
    assert target.read_bytes() == b"intact" and sorted(os.listdir(tmp_path)) == ["x.bin"]


def test_atomic_overwrite_and_mode(tmp_path):
    p = results.atomic_write_text(tmp_path / "a.json", "1")
    results.atomic_write_text(p, "2")
    assert p.read_text() == "2" and oct(p.stat().st_mode & 0o777) == oct(0o644)


def test_new_run_dir_is_unique(tmp_path):
    a, b = results.new_run_dir(tmp_path, tag="cpu"), results.new_run_dir(tmp_path, tag="cpu")
    assert a != b and a.is_dir() and b.is_dir()
    assert re.fullmatch(r"\d{8}-\d{6}-cpu(-\d+)?", a.name) and re.fullmatch(r"\d{8}-\d{6}-cpu(-\d+)?", b.name)


def test_load_runs_globs_and_run_column(tmp_path):
    r1, r2 = tmp_path / "20260101-000000-cpu", tmp_path / "20260102-000000-cpu"
    results.write_records(r1, _records(2), "a")
    results.write_records(r2, _records(1), "b")
    df = results.load_runs(str(tmp_path / "2026*"))
    assert sorted(df.run.unique()) == [r1.name, r2.name] and len(df) == 3
    assert len(results.load_runs(r1 / "a.parquet")) == 2
    assert results.load_runs(str(tmp_path / "nothing*")).empty
    with pytest.raises(FileNotFoundError):
        results.load_runs(tmp_path / "missing")


def test_env_info_cpu():
    env = results.env_info("cpu")
    for key in ("device_name", "compute_capability", "driver", "torch", "triton", "python", "labkit_rev",
                "hostname", "timestamp"):
        assert key in env
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if git.returncode != 0:
        assert env["labkit_rev"] == "unknown"
        pytest.skip("not a git checkout")
    assert env["labkit_rev"].removesuffix("+dirty") == git.stdout.strip()


def test_savefig_writes_png_and_svg(tmp_path):
    prof = pd.DataFrame(dict(category=["cast", "gather", "attention", "merge", "other", "total"],
                             device_ms=[3.0, 0.0, 1.0, 0.0, 0.0, 4.0], share=[.75, 0, .25, 0, 0, 1], calls=[1] * 6))
    prof.attrs["activity"] = "cpu"
    ax = plots.profile_bars(prof, title="step")
    assert len(ax.patches) == 5 and "cpu" in ax.get_xlabel()
    png, svg = plots.savefig(ax.figure, tmp_path, "profile")
    assert png.read_bytes()[:4] == b"\x89PNG" and b"<svg" in svg.read_bytes()[:500]
    assert _leftovers(tmp_path) == []
    plt.close("all")


def test_sweep_lines_has_units():
    df = pd.DataFrame(dict(path=["a", "a", "b", "b"], pool_tokens=[1, 2, 1, 2], us=[1.0, 2.0, 1.0, 1.5]))
    ax = plots.sweep_lines(df, "pool_tokens", "us", xlabel="pool tokens", ylabel="time per layer (us)", logx=True)
    assert len(ax.lines) == 2 and ax.get_ylabel() == "time per layer (us)"
    plt.close("all")


def test_finished_marker_and_run_states(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_RUN_DIR", raising=False)
    monkeypatch.delenv(results.ACTIVE_RUN_ENV, raising=False)
    done, killed, hand = tmp_path / "20260101-000000-cpu", tmp_path / "20260102-000000-cpu", tmp_path / "interactive"
    for d in (done, killed, hand):
        results.write_records(d, _records(2), "a")
    marker = results.mark_finished(done, "labkit run 01", notebooks=["01_x"])
    info = json.loads(marker.read_text())
    assert marker == done / results.FINISHED and info["what"] == "labkit run 01" and info["exit_status"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["finished"]) and info["notebooks"] == ["01_x"]
    assert _leftovers(done) == []
    df = results.load_runs(done, killed, hand)
    state = df.groupby("run").run_state.unique().map(list).to_dict()
    assert state == {done.name: ["finished"], killed.name: ["partial"], hand.name: ["interactive"]}
    assert df.run_finished.tolist() == [True] * 2 + [False] * 4
    monkeypatch.setenv(results.ACTIVE_RUN_ENV, str(killed))  # labkit run filling it: its own report
    monkeypatch.setenv("LABKIT_RUN_DIR", str(done))  # a marker outranks the hand-run folder
    assert [results.run_state(d) for d in (done, killed, hand)] == ["finished", "running", "interactive"]


def test_nested_folders_have_their_own_marker(tmp_path):
    """A study folder (benchmark records) holds a labkit run folder: each file answers to its own folder."""
    outer = tmp_path / "20260101-000000-cuda"
    inner = outer / "20260101-000100-cuda"
    results.write_records(outer, _records(1), "bench")
    results.write_records(inner, _records(2), "03_peers")
    results.mark_finished(inner, "labkit run")
    df = results.load_runs(outer)
    assert set(df.run) == {outer.name}
    assert df.groupby("file").run_finished.all().to_dict() == {"bench": False, "03_peers": True}


def test_partial_runs_are_labelled(tmp_path, monkeypatch):
    monkeypatch.delenv(results.ACTIVE_RUN_ENV, raising=False)
    done, killed = tmp_path / "20260101-000000-cpu", tmp_path / "20260102-000000-cpu"
    results.write_records(done, _records(1), "a")
    results.write_records(killed, _records(2), "a")
    results.mark_finished(done, "x")
    df = results.load_runs(done, killed)
    note = results.unfinished_note(df)
    assert note.startswith("partial: 1 run(s)") and killed.name in note and done.name not in note
    assert "\n" not in note
    labelled = results.label_partial(df)
    assert sorted(labelled.run.unique()) == [done.name, f"{killed.name} (partial)"]
    assert results.unfinished_note(results.load_runs(done)) == ""
    assert results.label_partial(results.load_runs(done)).run.tolist() == [done.name]


def test_load_runs_empty_has_the_state_columns(tmp_path):
    assert {"run", "file", "run_state", "run_finished"} <= set(results.load_runs(str(tmp_path / "none*")).columns)


def test_committed_reference_runs_are_finished_or_say_why_not():
    """Every committed folder with records is finished, or its study script logged the failed stage
    (or it is the partial notebook folder ``labkit run`` renamed ``-failed``) and it loads as partial."""
    folders = {f.parent for f in (REPO / "data" / "reference").rglob("*.parquet")}
    assert len(folders) > 5
    for folder in folders:
        if results.run_state(folder) == "finished":
            continue
        log = folder / "stages.log"
        assert folder.name.endswith("-failed") or (log.exists() and "not marked finished" in log.read_text()), folder
        assert not results.load_runs(folder).run_finished.any(), folder


def test_git_revision_prefers_the_stated_one(monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git: the revision given with it wins."""
    from labkit import envinfo

    monkeypatch.setenv("LAB_GIT_REV", "abc1234")
    assert envinfo.git_revision() == "abc1234"
    monkeypatch.delenv("LAB_GIT_REV")
    assert envinfo.git_revision() not in ("abc1234", "")
