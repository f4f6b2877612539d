"""``rlhf --version`` prints the installed distribution's version (package metadata) and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_metadata_version_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "--version"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"rlhf {version('rlhf-ops')}"
