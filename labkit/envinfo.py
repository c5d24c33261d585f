"""What a measurement ran on: device, driver, library versions and the lab's own git revision."""
from __future__ import annotations

import datetime as _dt
import platform
import re
import socket
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd=None) -> str | None:
    """stdout of ``cmd`` stripped, or None if it cannot run or fails."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_revision(repo: Path = REPO) -> str:
    """``$LAB_GIT_REV`` when set (a copy of the tree on a GPU machine, whose .git may be stale or
    absent: the revision the copy was made from), else ``git rev-parse HEAD`` with ``+dirty`` when
    tracked files differ from it, else ``unknown``."""
    if os.environ.get("LAB_GIT_REV"):
        return os.environ["LAB_GIT_REV"]
    rev = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if rev is None:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return rev + ("+dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def device_tag(device=None) -> str:
    """A short file-name-safe device label: ``cpu`` or e.g. ``cuda-nvidia-h200``."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def env_info(device) -> dict:
    """Flat dict of strings: device name, compute capability, driver, versions, git revision, host, UTC time."""
    dev = torch.device(device)
    info = dict(device=dev.type, device_name=_cpu_name(), compute_capability=None, driver=None,
                cuda_runtime=torch.version.cuda)
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        info.update(device_name=torch.cuda.get_device_name(dev), compute_capability="%d.%d" % cc)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.splitlines()[0] if smi else None
    info.update(torch=torch.__version__, triton=_triton_version(), python=platform.python_version(),
                labkit_rev=git_revision(), hostname=socket.gethostname(),
                timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                platform=sys.platform)
    return info
