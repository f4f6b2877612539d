"""The images' entrypoint scripts, run on the host with stub programs on PATH (no image, no container).

``docker/airflow-entrypoint.sh`` must hand every Airflow subcommand to ``airflow`` -- ``celery worker`` included,
although ``celery`` is also a program on PATH (Celery's own CLI, which rejects ``--celery-hostname``: the first
stack run failed that way) -- and run ``bash`` / ``python`` / absolute paths as given.
``docker/ray-entrypoint.sh`` builds the ``ray start`` command line of a head or a worker node.
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
