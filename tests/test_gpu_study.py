"""scripts/gpu_study.sh against the scripts it calls: a GPU call is scarce, so a stage that names a
variant, a tuning or a test file that no longer exists must fail here, on the CPU, not there."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "scripts" / "gpu_study.sh"
sys.path.insert(0, str(ROOT / "scripts"))


def _stages() -> dict[str, str]:
    """Each stage of the script's ``case`` as its name and its command, continuation lines joined."""
    text = STUDY.read_text().replace("\\\n", " ")
    return dict(re.findall(r"^\s*(\w+)\)\s*(stage .*?);;", text, flags=re.M))


def test_every_stage_named_in_the_header_exists():
    header = re.search(r'STAGES="([^"]+)"', STUDY.read_text()).group(1).split()
    stages = _stages()
    assert sorted(header) == sorted(stages), (header, sorted(stages))


def test_default_test_files_exist():
    cmd = _stages()["tests"]
    files = re.findall(r"tests/\w+\.py", cmd)
    assert len(files) >= 10
    assert [f for f in files if not (ROOT / f).is_file()] == []


@pytest.mark.parametrize("stage, script", [("topk", "gpu_topk.py"), ("gluon", "gpu_gluon.py"),
                                           ("first", "gpu_first_timing.py"), ("cand", "gpu_cand_parts.py")])
def test_stage_scripts_exist(stage, script):
    assert f"scripts/{script}" in _stages()[stage]
    assert (ROOT / "scripts" / script).is_file()
