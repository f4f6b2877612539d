"""Faults against an uninterrupted run: a kill after a time-based checkpoint, a preemption notice (SIGTERM), a hung
rollout worker (SIGSTOP), the remote store unreachable during a save, a resumed run with nothing left to train.

Every run is the real entrypoint (``python -m workers.entrypoints.train``, what ``rlhf train`` becomes) on the tiny
model, attached to the session's Ray cluster, 2 ranks over gloo. 32 prompts / 16 per batch x 2 epochs = 4 steps.
Each case records its figures (detected after, recovered after, steps lost / repeated, processes left behind) for
``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.config import dump_config, load_config
from rlhf_ops.storage.manifest import read_latest
from rlhf_ops.trainer.faults import EXIT_NOTHING_LEFT, EXIT_PREEMPTED, PREEMPTED_MARKER
from tests.reliability.conftest import Figures

# slow: 6 cases and a reference run, about 7 minutes on 2 shared cores (each case trains the tiny model 1-2 times).
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

RUN_TIMEOUT_S = 300
STEPS = 4
COMMON = [
    "trainer.total_epochs=2",
    "trainer.total_training_steps=null",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console,jsonl]",
    "trainer.save_freq=0",
    "data.val_files=[]",
    "data.toy_rows=32",
    "data.train_batch_size=16",
]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean")
# rlhf_ops/trainer/sample_ledger.py: equal at every step, exactly, when no sample was dropped or trained twice.
COUNTED = ("samples/step_count", "samples/consumed_total", "samples/consumed_digest")


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("preset") / "faults.yaml"
    path.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON])))
    return str(path)


class Run:
    """One ``train`` command in its own session (so that its process group can be signalled or killed at once)."""

    def __init__(self, root: Path, preset: str, ray_address: str, overrides: list[str], env: dict[str, str]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, "--ray-address", ray_address]
        self.cmd = [*entry, f"trainer.checkpoint_root={root}", *overrides]
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **env})
        self.log = root / "train.log"
        self.run_dir = root / "tiny-cpu" / "demo"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self.proc

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            pytest.fail(f"the run did not end within {timeout} s:\n{self.tail()}")

    def run(self) -> int:
        self.start()
        return self.wait()

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.strip()]

    def wait_until(self, ready: Any, what: str, timeout: float = RUN_TIMEOUT_S, poll_s: float = 0.005) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"the run exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                pytest.fail(f"no {what} within {timeout} s:\n{self.tail()}")
            time.sleep(poll_s)

    def left_behind(self) -> list[int]:
        """Live processes of the run's session (the driver's own and anything it started)."""
        assert self.proc is not None
        out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True, check=True).stdout
        rows = (line.split() for line in out.splitlines())
        return [int(p) for p, s, stat in rows if int(s) == self.proc.pid and stat[0] != "Z"]


def _same_metrics(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for mine, ref in zip(got, want, strict=True):
        for key in COMPARED:
            tolerance = 1e-5 * max(1.0, abs(ref[key]))
            assert abs(mine[key] - ref[key]) <= tolerance, (mine["step"], key, mine[key], ref[key])
        for key in COUNTED:
            assert mine[key] == ref[key], (mine["step"], key, mine[key], ref[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str) -> list[dict[str, Any]]:
    """The uninterrupted run's metrics, step by step."""
    run = Run(tmp_path_factory.mktemp("reference"), preset, ray_address, [], {})
    assert run.run() == 0, run.tail()
    assert [r["step"] for r in run.records()] == list(range(1, STEPS + 1))
    return run.records()


def _resume_and_compare(run: Run, reference: list[dict[str, Any]], committed: int, logged: int) -> float:
    """Reruns the same command; asserts it trains exactly ``committed + 1 .. STEPS`` with the reference's metrics."""
    start = time.monotonic()
    assert run.run() == 0, run.tail()
    seconds = time.monotonic() - start
    records = run.records()
    resumed = records[logged:]
    assert [r["step"] for r in resumed] == list(range(committed + 1, STEPS + 1)), (committed, logged, resumed)
    _same_metrics(records[:committed] + resumed, reference)
    assert read_latest(run.run_dir) == STEPS
    return seconds


def test_kill_after_a_time_based_checkpoint_loses_no_step_since_it(
    tmp_path: Path, preset: str, ray_address: str, reference: list[dict[str, Any]], figures: Figures
) -> None:
    # save_freq=0: every checkpoint before the last step is a time-based one.
    run = Run(tmp_path, preset, ray_address, ["trainer.save_every_s=0.5"], {})
    run.start()
    assert run.proc is not None
    run.wait_until(lambda: (read_latest(run.run_dir) or 0) >= 2, "a time-based checkpoint of step 2")
    saved_at = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGKILL)
    killed_after_commit_s = time.monotonic() - saved_at  # the wall time a kill now costs (at most save_every_s)
    run.proc.wait(timeout=30)
    committed = read_latest(run.run_dir) or 0
    logged = len(run.records())
    assert 2 <= committed < STEPS, "the run reached its last step before the kill: nothing was tested"
    assert "time-based checkpoint" in run.log.read_text()
    left = run.left_behind()
    recovered_s = _resume_and_compare(run, reference, committed, logged)
    figures.record(
        fault="SIGKILL after a time-based checkpoint (save_every_s=0.5, save_freq=0)",
        killed_after_commit_s=round(killed_after_commit_s, 3),
        steps_lost=0,
        steps_repeated=logged - committed,
        recovered_after_s=round(recovered_s, 1),
        processes_left=len(left),
    )
    assert left == []


def test_sigterm_checkpoints_within_the_grace_period_exits_preempted_and_resumes(
    tmp_path: Path, preset: str, ray_address: str, reference: list[dict[str, Any]], figures: Figures
) -> None:
    run = Run(tmp_path, preset, ray_address, ["trainer.preemption_grace_s=120"], {})
    run.start()
    assert run.proc is not None
    run.wait_until(lambda: len(run.records()) >= 1, "step 1")
    noticed = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)  # the notice goes to the driver alone, as a spot notice to PID 1
    rc = run.wait()
    stopped_s = time.monotonic() - noticed
    log = run.log.read_text()
    assert rc == EXIT_PREEMPTED, log[-4000:]
    logged = len(run.records())
    committed = read_latest(run.run_dir)
    assert committed == logged and 1 <= logged < STEPS, (committed, logged)  # the step it was in, saved: 0 lost
    assert f"{PREEMPTED_MARKER}: preempted at step {logged} of {STEPS}: checkpoint of step {logged}" in log
    left = run.left_behind()
    recovered_s = _resume_and_compare(run, reference, committed, logged)
    figures.record(
        fault="SIGTERM to the driver (preemption_grace_s=120)",
        detected_and_stopped_after_s=round(stopped_s, 2),
        steps_lost=0,
        steps_repeated=0,
        recovered_after_s=round(recovered_s, 1),
        processes_left=len(left),
    )
    assert left == []


def test_a_grace_period_too_short_for_a_save_says_so_and_exits_preempted(
    tmp_path: Path, preset: str, ray_address: str
) -> None:
    run = Run(tmp_path, preset, ray_address, ["trainer.preemption_grace_s=0.01"], {})
    run.start()
    assert run.proc is not None
    run.wait_until(lambda: len(run.records()) >= 1, "step 1")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == EXIT_PREEMPTED
    log = run.log.read_text()
    assert f"{PREEMPTED_MARKER}: could not checkpoint within trainer.preemption_grace_s=0.01 s" in log, log[-3000:]
    assert read_latest(run.run_dir) is None  # nothing half-written was promoted
    assert run.left_behind() == []


def _worker_pids(cls_name: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines() if f"ray::{cls_name}" in line]


def test_a_hung_rollout_worker_fails_the_step_within_the_watchdog_bound_naming_it(
    tmp_path: Path, preset: str, ray_address: str, figures: Figures
) -> None:
    bound_s = 8.0
    run = Run(tmp_path, preset, ray_address, [f"trainer.rollout_watchdog_s={bound_s}"], {})
    run.start()
    assert run.proc is not None
    run.wait_until(lambda: len(run.records()) >= 1, "step 1")
    pids = _worker_pids("ActorRolloutRefWorker")
    assert len(pids) == 2, pids  # the run's two ranks (the session cluster runs nothing else meanwhile)
    for pid in pids:  # a real hang: the processes stop answering, mid-step
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        rc = run.wait(timeout=bound_s + 60)
    finally:
        for pid in pids:  # killed by the group's shutdown; if not, let them go
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    failed_after = time.monotonic() - stopped
    log = run.log.read_text()
    assert rc not in (0, EXIT_PREEMPTED), log[-3000:]
    assert "rollout watchdog: ranks [0, 1] of actor_rollout_ref returned nothing from" in log, log[-3000:]
    assert f"within trainer.rollout_watchdog_s={bound_s:g} s" in log
    assert failed_after < bound_s + 30
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)] + run.left_behind()
    figures.record(
        fault=f"both rollout workers SIGSTOPped (rollout_watchdog_s={bound_s:g})",
        detected_after_s=round(failed_after, 1),
        processes_left=len(left),
    )
    assert left == []


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_resumed_run_with_nothing_left_ends_with_its_own_exit_code_and_says_so(
    tmp_path: Path, preset: str, ray_address: str
) -> None:
    run = Run(tmp_path, preset, ray_address, [], {})
    assert run.run() == 0, run.tail()
    assert run.run() == EXIT_NOTHING_LEFT, run.tail()
    assert f"rlhf: nothing left to train: the checkpoint at step {STEPS} already completed all {STEPS} steps" in (
        run.log.read_text()
    )
    assert len(run.records()) == STEPS  # nothing trained (or logged) a second time


@pytest.fixture(scope="module")
def store() -> Iterator[Any]:
    from tests.support.moto_server import running_moto_server

    with running_moto_server() as server:
        server.create_bucket("faults")
        yield server


def test_store_unreachable_during_a_save_retries_then_fails_naming_it_and_keeps_latest(
    tmp_path: Path, preset: str, ray_address: str, store: Any, figures: Figures
) -> None:
    from tests.support.fault_proxy import FaultProxy
    from tests.support.moto_server import aws_env

    with FaultProxy(store.endpoint_url, match=lambda method, path: True) as proxy:
        overrides = ["trainer.save_freq=1", "trainer.remote_store_url=s3://faults/runs"]
        overrides += ["trainer.store_retries=2", "trainer.store_backoff_s=0.2"]
        run = Run(tmp_path, preset, ray_address, overrides, aws_env(proxy.url))
        run.start()
        client = store.client()

        def remote_latest() -> bytes | None:
            try:
                return bytes(client.get_object(Bucket="faults", Key="runs/tiny-cpu/demo/latest")["Body"].read())
            except client.exceptions.NoSuchKey:
                return None

        run.wait_until(lambda: remote_latest() == b"global_step_1", "step 1 in the store", poll_s=0.05)
        proxy.always = "reset"  # from now on every request to the store has its connection reset
        cut = time.monotonic()
        rc = run.wait()
        failed_after = time.monotonic() - cut
    log = run.log.read_text()
    assert rc != 0, log[-3000:]
    assert "background checkpoint sync(s) to s3://faults/runs/tiny-cpu/demo failed" in log, log[-3000:]
    assert "retry 2/2" in log  # the bounded retries ran, with backoff
    assert remote_latest() == b"global_step_1"  # nothing half-uploaded was promoted
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="faults", Prefix="runs/").get("Contents", [])}
    assert not any(k.endswith("MANIFEST.json") and "global_step_1/" not in k for k in keys), sorted(keys)
    figures.record(
        fault="S3 unreachable (every connection reset) from step 2's upload on; store_retries=2",
        failed_after_s=round(failed_after, 1),
        remote_latest="global_step_1",
        processes_left=len(run.left_behind()),
    )
