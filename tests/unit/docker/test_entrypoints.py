"""The images' entrypoint scripts, run on the host with stub programs on PATH (no image, no container).

``docker/airflow-entrypoint.sh`` must hand every Airflow subcommand to ``airflow`` -- ``celery worker`` included,
although ``celery`` is also a program on PATH (Celery's own CLI, which rejects ``--celery-hostname``: the first
stack run failed that way) -- and run ``bash`` / ``python`` / absolute paths as given.
``docker/ray-entrypoint.sh`` builds the ``ray start`` command line of a head or a worker node, and a worker node passes
a SIGTERM on to its ranks before it stops Ray.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    """A folder of stub programs that print their name and arguments, one per line."""
    for name in ("airflow", "celery", "ray", "python", "bash"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho {name}\nfor a in "$@"; do echo "$a"; done\n')
        stub.chmod(0o755)
    return tmp_path


def _run(script: str, args: list[str], stubs: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": f"{stubs}:/usr/bin:/bin", **env}
    # /bin/bash explicitly: the stub `bash` on PATH must not run the script itself.
    return subprocess.run(
        ["/bin/bash", str(ROOT / "docker" / script), *args], capture_output=True, text=True, env=environ, timeout=30
    )


@pytest.mark.parametrize(
    ("args", "called"),
    [
        (["celery", "worker", "--celery-hostname", "default@%h"], ["airflow", "celery", "worker"]),
        (["airflow", "celery", "worker", "--queues", "heavy"], ["airflow", "celery", "worker"]),
        (["scheduler"], ["airflow", "scheduler"]),
        (["api-server"], ["airflow", "api-server"]),
        (["bash", "/opt/rlhf/bin/airflow-init.sh"], ["bash", "/opt/rlhf/bin/airflow-init.sh"]),
        (["python", "-c", "pass"], ["python", "-c"]),
    ],
)
def test_airflow_entrypoint_dispatch(stubs: Path, args: list[str], called: list[str]) -> None:
    out = _run("airflow-entrypoint.sh", args, stubs)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[: len(called)] == called


def test_airflow_entrypoint_runs_an_absolute_path_as_given(stubs: Path) -> None:
    out = _run("airflow-entrypoint.sh", [str(stubs / "celery"), "inspect"], stubs)
    assert out.stdout.splitlines() == ["celery", "inspect"]


def test_ray_entrypoint_head_and_worker(stubs: Path) -> None:
    head = _run("ray-entrypoint.sh", [], stubs, RAY_GCS_PORT="28720", RAY_START_ARGS="--num-cpus=2 --block-x")
    assert head.stdout.splitlines()[:3] == ["ray", "start", "--head"]
    assert {"--port=28720", "--num-gpus=0", "--num-cpus=2", "--block-x"} <= set(head.stdout.splitlines())
    worker = _run("ray-entrypoint.sh", [], stubs, RAY_NODE_TYPE="worker", RAY_HEAD_ADDRESS="127.0.0.1:28720")
    assert "--address=127.0.0.1:28720" in worker.stdout.splitlines()
    assert not any(a.startswith("--num-gpus") for a in worker.stdout.splitlines())


def test_ray_entrypoint_worker_without_head_address_says_what_to_set(stubs: Path) -> None:
    out = _run("ray-entrypoint.sh", [], stubs, RAY_NODE_TYPE="worker")
    assert out.returncode != 0
    assert "set RAY_HEAD_ADDRESS to the head GCS address" in out.stderr


def test_ray_entrypoint_rejects_an_unknown_node_type(stubs: Path) -> None:
    out = _run("ray-entrypoint.sh", [], stubs, RAY_NODE_TYPE="driver")
    assert out.returncode == 2
    assert out.stderr.strip() == "ray-entrypoint: RAY_NODE_TYPE must be 'head' or 'worker', got 'driver'"


def test_entrypoints_are_executable() -> None:
    for script in ("airflow-entrypoint.sh", "ray-entrypoint.sh", "airflow-init.sh"):
        assert os.access(ROOT / "docker" / script, os.X_OK), script


@pytest.mark.parametrize("rank_ends", [True, False])
def test_a_worker_node_passes_sigterm_to_its_ranks_then_stops_ray(tmp_path: Path, rank_ends: bool) -> None:
    # A node drained with notice: SIGTERM to the entrypoint reaches the node's rank first; Ray stops once the rank
    # has ended (the run checkpointed and ended the job), or when RAY_PREEMPTION_GRACE_S is over. The stub `ps`
    # lists only this test's own stand-in rank, so no other process of the machine is ever signalled.
    import signal
    import time

    got = tmp_path / "rank-got-sigterm"
    on_term = f"echo term > {got}; " + ("exit 0" if rank_ends else "")
    rank = subprocess.Popen(["bash", "-c", f"trap '{on_term}' TERM; while true; do sleep 0.05; done"])
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    agent = subprocess.Popen(["sleep", "60"])  # stands for Ray's own ray::DashboardAgent: never signalled
    alive = f"grep -qv ') Z' /proc/{rank.pid}/stat 2>/dev/null"  # (an ended rank stays a zombie of this test)
    listing = f"echo '{agent.pid} ray::DashboardAgent'\n{alive} && echo '{rank.pid} ray::Worker.update'\n"
    (stubs / "ps").write_text(f"#!/bin/sh\n{listing}")
    (stubs / "ray").write_text(f"#!/bin/sh\necho started > {tmp_path / 'ray-started'}\nexec sleep 60\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "RAY_NODE_TYPE": "worker", "RAY_HEAD_ADDRESS": "h:1"}
    node = subprocess.Popen(
        ["/bin/bash", str(ROOT / "docker" / "ray-entrypoint.sh")],
        env={**env, "RAY_PREEMPTION_GRACE_S": "3"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "ray-started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=20)
        seconds = time.monotonic() - start
        agent_alive = agent.poll() is None
    finally:
        rank.kill()
        node.kill()
        agent.kill()
    assert got.read_text().strip() == "term" and agent_alive  # the rank got the notice, Ray's agent nothing
    assert "passing SIGTERM to the node's Ray worker processes (1)" in err
    if rank_ends:
        assert "0 busy Ray worker process(es) left" in err and seconds < 2.5, (seconds, err)
    else:  # a rank that does not end: Ray is stopped when the grace period is over
        assert "1 busy Ray worker process(es) left" in err and 2.5 < seconds < 10, (seconds, err)


def test_a_notice_while_the_node_starts_never_leaves_ray_running(tmp_path: Path) -> None:
    # A SIGTERM at any moment of a worker node's start ends the entrypoint and Ray with it. Before the trap went in
    # ahead of `ray start`, a notice just after Ray had started (as soon as the stand-in writes its pid, the moment a
    # loaded CI host hit) killed bash and left the stand-in Ray running, holding the entrypoint's stderr.
    import signal
    import time

    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "ps").write_text("#!/bin/sh\n")  # no Ray worker process on this node
    (stubs / "ray").write_text(f"#!/bin/sh\necho $$ > {tmp_path}/ray-$PPID\nexec sleep 60\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "RAY_NODE_TYPE": "worker", "RAY_HEAD_ADDRESS": "h:1"}
    left = []
    for delay in [None] * 30 + [0.0, 0.005, 0.02, 0.05, 0.1]:  # None: as soon as the stand-in Ray has started
        node = subprocess.Popen(
            ["/bin/bash", str(ROOT / "docker" / "ray-entrypoint.sh")], env=env, stderr=subprocess.PIPE, text=True
        )
        started = tmp_path / f"ray-{node.pid}"
        if delay is None:
            deadline = time.monotonic() + 10
            while not started.exists() and time.monotonic() < deadline:
                pass
        else:
            time.sleep(delay)
        node.send_signal(signal.SIGTERM)
        try:
            node.communicate(timeout=8)  # returns once no process holds the entrypoint's stderr
        except subprocess.TimeoutExpired:
            left.append(delay)
            node.kill()
            os.kill(int(started.read_text()), signal.SIGKILL)
            node.communicate()
    assert left == [], f"Ray left running after a notice at {left} (None: just after Ray started)"
