"""Live metrics: a short tiny training (``python -m workers.entrypoints.train``, its own local Ray cluster with
``resources.metrics_export_port`` set); the test scrapes that port while the run runs and finds the trainer's step
metrics (with the values the run logged) and the rollout engine's own metrics, per rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from workers.live_metrics import RayMetricsLogger, prometheus_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> list[tuple[str, str, float]]:
    """``(name, labels, value)`` of every sample on the endpoint (empty while it is not up)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return []
    found = []
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match:
            found.append((match["name"], match["labels"], float(match["value"])))
    return found


def test_prometheus_names_are_valid_and_stable() -> None:
    assert prometheus_name("actor/pg_loss") == "rlhf_actor_pg_loss"
    assert prometheus_name("timing_s/update_actor") == "rlhf_timing_s_update_actor"
    assert prometheus_name("critic/score/mean") == "rlhf_critic_score_mean"
    assert prometheus_name("perf/mfu@bf16") == "rlhf_perf_mfu_bf16"
    assert RayMetricsLogger(experiment="e", run="r").tags == {"experiment": "e", "run": "r"}


def test_a_run_is_scraped_while_it_runs(tmp_path: Path) -> None:
    metrics_port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_metrics_report_interval_ms": "500", "PYTHONPATH": f"{ROOT}:{ROOT}/plugins"})
    overrides = [
        "trainer.logger=[jsonl,prometheus]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.checkpoint_root={tmp_path / 'ckpt'}",
        "trainer.run_name=live",
        f"resources.metrics_export_port={metrics_port}",
    ]
    # `rlhf train` starting its own local cluster (never a stale one on the machine) with the port set.
    train_cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", "tiny-cpu", "--ray-address", "local"]
    run = subprocess.Popen(
        [*train_cmd, *overrides],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    seen: dict[str, list[tuple[str, float]]] = {}
    try:
        deadline = time.monotonic() + 420
        while run.poll() is None and time.monotonic() < deadline:  # scraped during the run, never after it
            for name, labels, value in _scrape(metrics_port):
                if name.startswith("ray_rlhf_"):
                    seen.setdefault(name, []).append((labels, value))
            time.sleep(0.5)
        output = run.communicate(timeout=120)[0].decode(errors="replace") if run.poll() is not None else ""
        assert run.returncode == 0, output[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)
    assert "ray_rlhf_trainer_step" in seen, sorted(seen)
    steps = {value for labels, value in seen["ray_rlhf_trainer_step"] if 'run="live"' in labels}
    assert steps and min(steps) >= 1 and max(steps) <= STEPS
    # A scraped value is one the run logged (metrics.jsonl of the run folder); the entropy and grad norm change
    # every step, so a stale or made-up value fails.
    logged = [json.loads(line) for line in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    assert len(logged) == STEPS
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
        values = {row[key] for row in logged}
        scraped = {value for labels, value in seen[prometheus_name(key, prefix="ray_rlhf_")] if 'run="live"' in labels}
        assert scraped and all(any(abs(s - v) <= 1e-6 * max(1.0, abs(v)) for v in values) for s in scraped), (
            key,
            scraped,
            values,
        )
    assert len({v for _, v in seen["ray_rlhf_actor_entropy"]}) >= 2  # seen moving while the run ran
    # The rollout engine's own metrics, per rank.
    ranks = {re.findall(r'rank="(\d+)"', labels)[0] for labels, _ in seen["ray_rlhf_rollout_generate_seconds"]}
    assert ranks == {"0", "1"}
    tokens = [value for _, value in seen["ray_rlhf_rollout_response_tokens_total"]]
    assert max(tokens) > 0
