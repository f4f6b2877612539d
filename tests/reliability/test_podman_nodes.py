"""Multi-node training across separate containers, and a node lost or preempted mid-run.

A podman network of its own with a moto S3 container, a Ray head container and worker-node containers
(``tests/support/podman_nodes.py``): each node has its own filesystem and address, nothing is mounted, and S3 is the
only store they share. ``rlhf train`` (the tiny model, ``resources.nnodes=2`` x 1 rank, gloo over the network,
``trainer.shared_checkpoint_root=false``: each rank uploads its own shards; a checkpoint every step in
``s3://``) is submitted through the Ray Jobs API, 6 steps. Against an uninterrupted run of the same command:

* a worker node SIGKILLed (``podman kill -s KILL``) once step 2 is committed: the job fails with a line naming
  the rank and the node's address; the same command again resumes from the store alone on another pair of nodes
  (the survivor and one the first run did not use) and trains each missing step once;
* a worker node given notice (``podman kill -s TERM``, as a drained node's container gets) once step 2 is
  committed: its entrypoint passes the notice to its rank, the trainer checkpoints the step it is in, the job ends
  as preempted (exit 75) within ``trainer.preemption_grace_s``, the node's container ends by itself, and the rerun
  on another pair (the survivor and a fresh node) resumes with no step lost or repeated.

Every resumed history's metrics equal the uninterrupted run's at every step (within 1e-5; the sample ledger's
counts exactly). About 2.5 minutes on 2 shared cores with the images built; skipped without podman or the images.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.reliability.conftest import Figures
from tests.reliability.test_faults_recovery import _same_metrics
from tests.support.moto_server import aws_env
from tests.support.podman_nodes import MODEL_DIR, PodmanCluster, missing_prerequisite, podman, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]

BUCKET, STEPS, GRACE_S = "rlhf-nodes", 6, 60.0
JOB_TIMEOUT_S, FAIL_BOUND_S = 420.0, 180.0
COMMON = [
    f"model.path={MODEL_DIR}",  # the tiny model, staged on every node's own disk at this path
    "resources.nnodes=2",
    "resources.nproc_per_node=1",
    "trainer.total_epochs=2",
    "trainer.total_training_steps=null",
    "data.toy_rows=48",  # 48 prompts / 16 per batch x 2 epochs = 6 steps
    "data.train_batch_size=16",
    "data.val_files=[]",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=1",
    "trainer.logger=[console,jsonl]",
    "trainer.experiment_name=nodes",
    f"trainer.remote_store_url=s3://{BUCKET}/runs",
    "trainer.shared_checkpoint_root=false",  # no shared disk: each rank uploads its own shards
    f"trainer.preemption_grace_s={GRACE_S:g}",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[PodmanCluster]:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    c = PodmanCluster(tmp_path_factory.mktemp("podman-nodes"), model_dir=tiny_model_dir, node_grace_s=GRACE_S)
    try:
        try:
            wait_for("the Ray head's dashboard", lambda: bool(c.alive_nodes()), 180, poll_s=1.0)
        except TimeoutError:
            if not c.running(c.head):
                raise
            pytest.skip(f"this host cannot reach the podman network's addresses ({c.dashboard}); rootless podman?")
        _s3(c).create_bucket(Bucket=BUCKET)
        c.wait_nodes([c.add_node() for _ in range(3)])
        yield c
    finally:
        c.close()
    assert podman("ps", "-a", "--filter", f"label={c.label}", "-q").stdout.split() == []


def _s3(c: PodmanCluster) -> Any:
    import boto3

    env = aws_env(c.s3_url)
    return boto3.client(
        "s3",
        endpoint_url=c.s3_url,
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def _latest(c: PodmanCluster, run: str) -> int:
    """The step of the run's latest complete checkpoint in the store (0: none)."""
    try:
        body = _s3(c).get_object(Bucket=BUCKET, Key=f"runs/nodes/{run}/latest")["Body"].read().decode()
    except Exception:  # no checkpoint yet
        return 0
    return int(body.strip().rsplit("_", 1)[-1])


class Job:
    """One ``rlhf train`` submitted to the cluster's Ray Jobs API (the command a rerun submits again)."""

    def __init__(self, c: PodmanCluster, run: str) -> None:
        from ray.job_submission import JobSubmissionClient

        self.c, self.run = c, run
        self.client = JobSubmissionClient(c.dashboard)
        overrides = [*COMMON, f"trainer.run_name={run}", f"trainer.checkpoint_root=/checkpoints/{run}"]
        self.entrypoint = " ".join(["python -m workers.entrypoints.train --preset tiny-cpu", *overrides])
        self.metrics_path = f"/checkpoints/{run}/nodes/{run}/metrics.jsonl"

    def submit(self) -> str:
        runtime_env = {"env_vars": aws_env(self.c.s3_url)}  # the ranks upload their shards: they need the store
        self.id = self.client.submit_job(entrypoint=self.entrypoint, runtime_env=runtime_env)
        self.started = time.monotonic()
        return self.id

    def status(self) -> str:
        return str(self.client.get_job_status(self.id))

    def done(self) -> bool:
        return self.status().rsplit(".", 1)[-1] in ("SUCCEEDED", "FAILED", "STOPPED")

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> float:
        """Seconds since ``since`` (default: the submission) when the job ended."""
        wait_for(f"job {self.id} ({self.run}) to end", self.done, timeout_s, poll_s=0.2)
        seconds = time.monotonic() - self.started
        (self.c.work / f"{self.run}-{self.id}.log").write_text(self.logs())  # kept with the containers' logs
        return seconds

    def exit_code(self) -> int | None:
        return self.client.get_job_info(self.id).driver_exit_code

    def logs(self) -> str:
        return str(self.client.get_job_logs(self.id))

    def records(self) -> list[dict[str, Any]]:
        text = self.c.read(self.c.head, self.metrics_path)  # the driver's disk: the head container's
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def wait_placed(self) -> list[str]:
        """The worker-node containers of the job's ranks, in rank order, once its resource pool is placed."""
        wait_for(f"the ranks of {self.run} placed", lambda: "resource pool " in self.logs(), JOB_TIMEOUT_S)
        nodes = _run_nodes(self.logs(), self.c)
        return [nodes[rank] for rank in sorted(nodes)]

    def wait_committed(self, step: int) -> None:
        def ready() -> bool:
            if self.done():
                raise AssertionError(f"job {self.run} ended ({self.status()}) first:\n{self.logs()[-4000:]}")
            return _latest(self.c, self.run) >= step

        wait_for(f"checkpoint {step} of {self.run} in the store", ready, JOB_TIMEOUT_S, poll_s=0.1)


def _run_nodes(logs: str, c: PodmanCluster) -> dict[int, str]:
    """``{rank: node container}`` of the run whose logs these are (the resource pool's rank -> node line)."""
    placed = re.search(r"resource pool .*: 2 rank\(s\) on 2 node\(s\); rank -> node: (.+)", logs)
    assert placed, logs[-4000:]
    node_of = {int(rank): node.strip() for rank, node in (pair.split(":", 1) for pair in placed.group(1).split(","))}
    rows = c.api("/api/v0/nodes?limit=100&detail=true")["data"]["result"]["result"]
    ip_of = {row["node_id"]: row["node_ip"] for row in rows}
    container_of = {c.ip(name): name for name in c.nodes if c.running(name)}  # (a lost node has no address)
    return {rank: container_of[ip_of[node]] for rank, node in node_of.items()}


def _left_behind(c: PodmanCluster, nodes: list[str]) -> list[str]:
    """Processes of a run still alive in the head and the given node containers, 30 s after its job ended."""
    left: list[str] = []

    def gone() -> bool:
        left[:] = [f"{name}: {p}" for name in [c.head, *nodes] for p in c.run_processes(name)]
        return not left

    try:
        wait_for("the run's processes to end", gone, 30, poll_s=1.0)
    except TimeoutError:
        pass
    return left


@pytest.fixture(scope="module")
def reference(cluster: PodmanCluster) -> list[dict[str, Any]]:
    """The uninterrupted run's metrics, step by step."""
    job = Job(cluster, "reference")
    job.submit()
    job.wait()
    assert job.status().endswith("SUCCEEDED"), job.logs()[-4000:]
    logs = job.logs()
    # One gloo group of world size 2 across two containers, checkpoints written on each node and uploaded by it.
    assert re.search(r"\] gloo process group of 2 rank\(s\) across 2 node\(s\)", logs), logs[-4000:]
    assert len(set(_run_nodes(logs, cluster).values())) == 2
    assert [r["step"] for r in job.records()] == list(range(1, STEPS + 1))
    assert _latest(cluster, "reference") == STEPS
    return job.records()


def _rerun_and_compare(job: Job, reference: list[dict[str, Any]], committed: int, logged: int) -> tuple[float, str]:
    """Submit the same command again; it must resume from the store at ``committed`` on nodes its first run did not
    use together, train ``committed + 1 .. STEPS`` once, with the reference's metrics. Returns its seconds, logs."""
    job.submit()
    seconds = job.wait()
    logs = job.logs()
    assert job.status().endswith("SUCCEEDED"), logs[-4000:]
    assert "downloading checkpoint s3://" in logs and f"(step {committed})" in logs, logs[-4000:]
    records = job.records()
    resumed = records[logged:]
    assert [r["step"] for r in resumed] == list(range(committed + 1, STEPS + 1)), (committed, logged, resumed)
    _same_metrics(records[:committed] + resumed, reference)
    assert _latest(job.c, job.run) == STEPS
    return seconds, logs


def _running_past_step_2(job: Job) -> tuple[list[str], str, str, str]:
    """Submits ``job`` and waits until it runs on two nodes with step 2 committed (step 3 running): the pair, the
    node to fault (the second), the survivor and the faulted node's address."""
    job.submit()
    pair = job.wait_placed()
    assert len(set(pair)) == 2, pair
    victim, survivor = pair[1], pair[0]
    victim_ip = job.c.ip(victim)
    job.wait_committed(2)
    return pair, victim, survivor, victim_ip


def test_a_node_killed_mid_step_fails_the_job_naming_it_and_a_rerun_elsewhere_resumes_exactly(
    cluster: PodmanCluster, reference: list[dict[str, Any]], figures: Figures
) -> None:
    c, job = cluster, Job(cluster, "killed")
    pair, victim, survivor, victim_ip = _running_past_step_2(job)
    killed = time.monotonic()
    podman("kill", "-s", "KILL", victim)
    wait_for("the job to fail after the kill", job.done, FAIL_BOUND_S, poll_s=0.2)
    detected_s = time.monotonic() - killed
    logs = job.logs()
    assert job.status().endswith("FAILED"), logs[-4000:]
    cause = re.search(rf"\] rank \d on node {re.escape(victim_ip)} \(pid \d+\) failed in \w+\(\)[^\n]*", logs)
    assert cause, logs[-4000:]  # one line: the role, the rank, the lost node's address and the call
    left = _left_behind(c, [survivor])
    logged, committed = len(job.records()), _latest(c, "killed")
    assert committed == logged and 2 <= committed < STEPS, (committed, logged)  # every logged step was committed
    fresh = [n for n in c.nodes if n not in pair and c.running(n)]
    c.wait_nodes([survivor, *fresh])  # the lost node is gone from Ray
    recovered_s, rerun_logs = _rerun_and_compare(job, reference, committed, logged)
    nodes = set(_run_nodes(rerun_logs, c).values())  # another pair: the survivor and a node the first run did not use
    assert len(nodes) == 2 and victim not in nodes and nodes != set(pair), (nodes, pair)
    figures.record(
        fault="worker node container SIGKILLed after the step-2 checkpoint (podman kill -s KILL)",
        cause=cause.group(0)[:200],
        detected_after_s=round(detected_s, 1),
        recovered_after_s=round(recovered_s, 1),
        resumed_from=committed,
        steps_lost=0,
        steps_repeated=0,
        processes_left=len(left),
        containers_left=0,
    )
    assert left == []


def test_a_node_preempted_with_notice_checkpoints_ends_preempted_and_a_rerun_elsewhere_resumes(
    cluster: PodmanCluster, reference: list[dict[str, Any]], figures: Figures
) -> None:
    c, job = cluster, Job(cluster, "preempted")
    pair, victim, survivor, victim_ip = _running_past_step_2(job)
    noticed = time.monotonic()
    podman("kill", "-s", "TERM", victim)
    wait_for("the job to end after the notice", job.done, GRACE_S + 30, poll_s=0.2)
    stopped_s = time.monotonic() - noticed
    logs = job.logs()
    assert job.exit_code() == 75, (job.status(), logs[-4000:])
    logged, committed = len(job.records()), _latest(c, "preempted")
    assert committed == logged and 2 <= committed < STEPS, (committed, logged)  # the step it was in, saved
    marker = re.search(
        rf"rlhf: preempted: preempted at step {committed} of {STEPS}: checkpoint of step {committed} committed "
        rf"([\d.]+) s after the notice \(SIGTERM to rank \d of \w+ on node {re.escape(victim_ip)} \(pid \d+\)",
        logs,
    )
    assert marker and float(marker.group(1)) < GRACE_S, logs[-4000:]
    # The node's container ends by itself once its rank is gone (the entrypoint stops Ray after the drain).
    container_s = wait_for("the preempted node's container to exit", lambda: not c.running(victim), GRACE_S + 30)
    left = _left_behind(c, [survivor])
    c.add_node()  # a fresh node: the rerun runs on it and the survivor
    c.wait_nodes([n for n in c.nodes if c.running(n)])
    recovered_s, rerun_logs = _rerun_and_compare(job, reference, committed, logged)
    nodes = set(_run_nodes(rerun_logs, c).values())  # another pair: the survivor and a node the first run did not use
    assert len(nodes) == 2 and victim not in nodes and nodes != set(pair), (nodes, pair)
    figures.record(
        fault=f"worker node given notice after the step-2 checkpoint (podman kill -s TERM; grace {GRACE_S:g} s)",
        detected_and_stopped_after_s=round(stopped_s, 1),
        checkpoint_after_notice_s=float(marker.group(1)),
        container_exited_after_s=round(stopped_s + container_s, 1),
        container_exit_code=c.exit_code(victim),
        recovered_after_s=round(recovered_s, 1),
        resumed_from=committed,
        steps_lost=0,
        steps_repeated=0,
        processes_left=len(left),
        containers_left=0,
    )
    assert left == []
