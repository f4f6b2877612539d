"""SIGKILL of one part of a real 2-rank ``rlhf train`` (tiny preset, local Ray cluster) mid-run: one worker rank
(a Ray actor process), or the Ray head (the GCS of the cluster the run started). The driver fails with a clear
error instead of hanging, every process of the run is gone within a bound (workers, raylet, GCS, agents), and
``rlhf train`` again resumes from the last complete checkpoint: 0 lost and 0 repeated optimizer steps, every
step's metrics equal to an uninterrupted run's (timings and RSS aside).

A SIGTERM to one worker rank (a node's preemption notice reaching a rank, not the driver) is no failure: the rank
passes it to the driver (``workers/preemption.py``), which checkpoints the step it is in and exits 75; the rerun
resumes from that checkpoint.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.process_reaper import processes_with_token
from rlhf_ops.storage.manifest import read_latest
from rlhf_ops.trainer.faults import EXIT_PREEMPTED, PREEMPTED_MARKER
from tests.reliability.conftest import Figures
from tests.reliability.test_kill import _records, _run_token, _train

STEPS, KILL_AFTER = 4, 3  # a checkpoint at step 2; killed once step 3 is logged
FAIL_BOUND_S = 180.0  # the driver ends (non-zero) within this after the kill
CLEAN_BOUND_S = 15.0  # then nothing of the run is left within this
OVERRIDES = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console,jsonl]",
    "data.val_files=[]",
]
_VARIES = ("timestamp", "timing", "perf/", "time/", "memory/")  # wall-clock and RSS figures: differ run to run


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def worker_rank(token: str) -> list[int]:
    """A Ray actor process of the run (the newest: the last rank created)."""
    actors = [p for p in processes_with_token(token) if _cmdline(p).startswith("ray::") and "IDLE" not in _cmdline(p)]
    return sorted(actors)[-1:]


def ray_head(token: str) -> list[int]:
    """The head's GCS server of the run's local cluster."""
    return [p for p in processes_with_token(token) if _comm(p).startswith("gcs_server")]


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith(_VARIES)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (NaN equals NaN; absent keys differ)."""
    bad = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, "absent"), b.get(key, "absent")
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            bad.append(f"{key}: {x} != {y}")
    return bad


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = _train(root, OVERRIDES)
    assert proc.wait(timeout=900) == 0, (root / "train.log").read_text()[-3000:]
    return {int(r["step"]): _comparable(r) for r in _records(root / "tiny-cpu" / "demo")}  # type: ignore[call-overload]


def _wait_for(what: str, check: Callable[[], bool], bound_s: float) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > bound_s:
            pytest.fail(f"{what}: not within {bound_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    ("target", "find", "sig"),
    [
        ("worker_rank", worker_rank, signal.SIGKILL),
        # A node's preemption notice reaching a worker process rather than the driver.
        ("worker_rank_sigterm", worker_rank, signal.SIGTERM),
        ("ray_head", ray_head, signal.SIGKILL),
    ],
)
def test_killing_a_part_of_the_ray_run_fails_the_driver_cleans_up_and_resumes_exactly(
    tmp_path: Path,
    figures: Figures,
    uninterrupted: dict[int, dict[str, Any]],
    target: str,
    find: Callable[[str], list[int]],
    sig: signal.Signals,
) -> None:
    run_dir, log = tmp_path / "tiny-cpu" / "demo", tmp_path / "train.log"
    proc = _train(tmp_path, OVERRIDES)
    deadline = time.monotonic() + 900
    # The notice: after step 2, so that the run is still in a step when it arrives (the last step ends it anyway).
    kill_after = 2 if sig == signal.SIGTERM else KILL_AFTER
    while len(_records(run_dir)) < kill_after:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    token = _run_token(proc.pid)
    victims = find(token)
    assert len(victims) == 1, (target, [(p, _cmdline(p)) for p in processes_with_token(token)])
    before = len(processes_with_token(token))
    os.kill(victims[0], sig)
    fail_s = _wait_for("the driver ends after the kill", lambda: proc.poll() is not None, FAIL_BOUND_S)
    clean_s = _wait_for("every process of the run is gone", lambda: not processes_with_token(token), CLEAN_BOUND_S)
    text = log.read_text(errors="replace")
    logged = _records(run_dir)
    committed = read_latest(run_dir) or 0
    if sig == signal.SIGTERM:  # a notice: the step it arrived in is checkpointed, the run ends as preempted
        assert proc.returncode == EXIT_PREEMPTED, text[-3000:]
        assert committed == len(logged) and kill_after <= committed < STEPS, (committed, len(logged))
        notice = f"{PREEMPTED_MARKER}: preempted at step {committed} of {STEPS}: checkpoint of step {committed}"
        assert notice in text, text[-3000:]  # naming the rank that received it, its node and pid
        assert re.search(rf"\(SIGTERM to rank \d of \w+ on node 127\.0\.0\.1 \(pid {victims[0]}\)", text), text[-3000:]
    else:
        assert proc.returncode != 0, f"the driver exited 0 after its {target} was killed"
    if target == "worker_rank":  # the error names the role, the rank whose process died and its node
        assert "failed in" in text and "rank" in text and "ActorDiedError" in text, text[-3000:]
        assert " on node 127.0.0.1 (pid " in text, text[-3000:]  # the first line names the node
        assert committed == 2, committed  # a killed rank stops the step it is in
    if target == "ray_head":
        # Ray's actors outlive a killed GCS for its 60 s reconnect window, so a tiny run killed at its head may
        # finish and commit its last step before the driver gives up.
        assert committed in (2, STEPS), committed

    resumed = _train(tmp_path, OVERRIDES)
    assert resumed.wait(timeout=900) == 0, log.read_text()[-3000:]
    after = _records(run_dir)[len(logged) :]
    new_steps = [int(r["step"]) for r in after]  # type: ignore[call-overload]
    assert new_steps == list(range(committed + 1, STEPS + 1)), (committed, new_steps)
    # The final model's history: steps 1..committed of the killed run, the rest of the resumed one.
    history = {int(r["step"]): _comparable(r) for r in logged if int(r["step"]) <= committed}  # type: ignore[call-overload]
    history |= {int(r["step"]): _comparable(r) for r in after}  # type: ignore[call-overload]
    assert sorted(history) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    differences = {step: _same(history[step], uninterrupted[step]) for step in history}
    assert all(not d for d in differences.values()), differences
    figures.record(
        **{
            f"{target}_kills": 1,
            f"{target}_processes_at_kill": before,
            f"{target}_seconds_to_fail": round(fail_s, 2),
            f"{target}_seconds_to_clean": round(clean_s, 2),
            f"{target}_resumed_from": committed,
            f"{target}_lost_steps": 0,
            f"{target}_repeated_steps": 0,
            f"{target}_metric_differences": 0,
        }
    )
