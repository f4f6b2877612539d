"""The main job as a person sees it: ``rlhf demo`` prints a short, readable run and leaves a learning curve.

Runs the real demo in a fresh process (it refuses a process that imported Airflow): Ray head, MLflow server,
Airflow on SQLite, the ``rlhf_ppo`` DAG with ``dag.test()``. Its stdout is a pipe, so the training bar prints
a line per fifth of the run; everything else (Airflow's, Ray's and MLflow's records) goes to the log file whose
path is printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

TASKS = [
    "prepare_data",
    "preflight",
    "start_tracking",
    "train",
    "sync_and_retain",
    "register_model",
    "promote_champion",
    "end_tracking",
]


# slow (~150 s): the pipeline itself runs by default in test_pipeline_dag.py and the Chromium form test
@pytest.mark.slow
def test_demo_prints_under_60_lines_with_summary_and_curve(tmp_path: Path) -> None:
    root = tmp_path / "rlhf"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_ops.cli", "demo", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=1400,
        env=env,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, f"demo failed:\n{out}\n{done.stderr[-3000:]}"
    lines = out.splitlines()
    assert len(lines) < 60, f"{len(lines)} lines:\n{out}"
    for task in TASKS:  # one line as each task starts and one as it ends
        assert any(line.strip() == f"▸ {task}" for line in lines), f"no start line for {task}:\n{out}"
        assert any(re.match(rf"\s+✓ {task}\s+success\s+[\d.]+ s$", line) for line in lines), out
    bars = [line for line in lines if line.lstrip().startswith("train [")]
    assert 1 <= len(bars) <= 6 and "30/30" in bars[-1] and "reward" in bars[-1], out
    assert "DAG run success" in out and "train reward (mean of 5 steps):" in out
    # The table: one row per evaluated checkpoint (10, 20, 30): step, train reward, acc, reward, pass@4.
    rows = [line.split() for line in lines if re.match(r"\s+(10|20|30)\s+\d\.\d{3}\s", line)]
    assert [int(r[0]) for r in rows] == [10, 20, 30], out
    acc = [float(r[2]) for r in rows]
    assert acc[-1] > acc[0] and max(acc) >= 0.8, f"greedy accuracy by checkpoint {acc}:\n{out}"  # it learns
    assert sum("chosen" in r and "not" not in r for r in rows) == 1  # one "chosen", the others "not chosen (...)"
    log_file = Path(re.search(r"full logs:\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    assert log_file.is_file() and len(log_file.read_text().splitlines()) > 200  # the details are there
    curve = Path(re.search(r"learning curve: (\S+)", out).group(1))  # type: ignore[union-attr]
    assert curve.is_file() and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and curve.stat().st_size > 10_000
    assert "champion moved" in out  # the first run has no champion to beat
    logged = list((root / "mlflow" / "artifacts").rglob("plots/learning_curve.png"))
    assert len(logged) == 1 and logged[0].read_bytes() == curve.read_bytes()
