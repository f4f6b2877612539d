"""The Airflow side must never pull torch / vllm / transformers (scheduler, API server and triggerer images)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.airflow_env import configure_airflow_env

ROOT = Path(__file__).resolve().parents[3]


def test_plugin_modules_import_without_heavy_ml_libraries() -> None:
    code = (
        "import rlhf_airflow.operators, rlhf_airflow.hooks, rlhf_airflow.triggers, rlhf_airflow.links, rlhf_plugin\n"
        "import sys\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    env = {**os.environ, "AIRFLOW_HOME": str(configure_airflow_env())}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
