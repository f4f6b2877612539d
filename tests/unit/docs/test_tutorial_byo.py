"""The tutorial "Bring your own dataset, reward and model" runs as written.

Every ```bash block of docs/tutorial_byo.md, in order, in one shell (``set -euo pipefail``) inside an empty folder,
with the virtualenv's ``bin/`` first on ``PATH`` as the page tells the reader: the raw JSONL, ``rlhf
prepare-data`` with a field map, a reward function in the reader's own package (allowed by
``RLHF_ALLOWED_CODE_MODULES``), a copied model folder, the pre-flight, and two training steps on two CPU ranks of a
local Ray cluster, ending in a committed checkpoint. A command that fails fails the test with its output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "tutorial_byo.md"

pytestmark = pytest.mark.integration


def tutorial_script() -> str:
    """The page's bash blocks joined into one script (YAML and other blocks are not commands)."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 6, "the tutorial lost its commands"
    return "set -euo pipefail\n" + "\n".join(blocks)


@pytest.mark.slow  # the page's commands end to end, a training run included (~40 s here)
def test_tutorial_commands_run_and_train_to_a_checkpoint(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        # The worktree's code (a clone's editable install gives the same), also for the Ray workers.
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("RAY_ADDRESS", None)  # the tutorial starts its own local cluster
    env.pop("RLHF_ALLOWED_CODE_MODULES", None)  # the page sets it
    done = subprocess.run(
        ["bash", "-c", tutorial_script()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    work = tmp_path / "byo"
    assert "1.0 0.0" in done.stdout  # the reward scores a right and a wrong answer
    prepared = work / "data" / "r1"
    assert (prepared / "rejected.jsonl").read_text() == ""  # every sum row was accepted
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["counts"]["rows_read"] == 300 and manifest["counts"]["rejected"] == 0
    assert "preflight ok" in (work / "resolved.yaml").read_text()  # the --check output the page redirects
    run = work / "checkpoints" / "tiny-cpu" / "byo"
    assert (run / "global_step_2" / "MANIFEST.json").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert sorted(set(steps)) == [1, 2]
