"""Cheap checks of the deployment files (no image is built for real, no service starts).

- ``docker/compose.yaml`` renders and validates like ``docker compose config`` with ``docker/.env.example``
  (``tests/support/compose_config.py``: no compose CLI here) and wires the services the docs list;
- every Dockerfile takes its base image as ``BASE_IMAGE`` with an official image as the default, and its first
  stage builds from the local Debian base (``docker/podman-setup.sh``): the ``ARG``/``FROM`` preamble of each
  file plus ``RUN true``, so seconds and no network;
- ``scripts/stack.sh``'s bad-input paths answer with one line: no base image, a stack already up, a port
  taken, a container that exited (``status``; ``up`` uses the same line while it waits), an unknown command;
  ``down`` removes the stack's own containers and volumes and nothing else.

The podman tests need podman and the local base: setup_env.sh installs both as root; they skip (with the
reason) only where ``docker/podman-setup.sh`` cannot.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.compose_config import ComposeError, read_env_file, render

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker/compose.yaml"
LOCAL_BASE = "local/debian:bookworm"
DOCKERFILES = {
    "airflow.Dockerfile": "apache/airflow:${AIRFLOW_VERSION}-python${AIRFLOW_PYTHON_VERSION}",
    "mlflow.Dockerfile": "python:3.11-slim",
    "services.Dockerfile": "debian:bookworm-slim",
    "worker-cpu.Dockerfile": "python:3.11-slim-bookworm",
    "worker.Dockerfile": "nvidia/cuda:13.0.2-devel-ubuntu24.04",
}


def test_compose_config_renders_with_the_example_env() -> None:
    """What ``docker compose -f docker/compose.yaml --env-file docker/.env.example config`` checks."""
    model = render(COMPOSE, read_env_file(ROOT / "docker/.env.example"))
    assert set(model["services"]) == {
        "postgres",
        "minio",
        "minio-init",
        "mlflow",
        "airflow-init",
        "airflow-api-server",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "ray-head",
        "ray-gpu-worker",
    }
    services = model["services"]
    # Every Airflow component shares the one image; both Ray nodes share the worker image.
    assert {s["image"] for n, s in services.items() if n.startswith("airflow-")} == {"rlhf-ops/airflow:dev"}
    assert services["ray-head"]["image"] == services["ray-gpu-worker"]["image"] == "rlhf-ops/worker:dev"
    # Interpolated from the env file, merged from the anchors, `$$` unescaped for the container's shell.
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == (
        "postgresql+psycopg2://airflow:change-me-airflow-db@postgres:5432/airflow"
    )
    assert services["airflow-triggerer"]["healthcheck"]["test"][1].endswith('--hostname "${HOSTNAME}"')
    assert services["airflow-init"]["restart"] == "no"
    assert services["mlflow"]["ports"] == ["127.0.0.1:5000:5000"]
    # The heavy tasks are Ray jobs: the task processes (LocalExecutor: the scheduler) only read their results,
    # from the work folder on the volume the Ray nodes write.
    assert env["RLHF_WORK_DIR"] == "/checkpoints/pipelines"
    assert "checkpoints:/checkpoints:ro" in services["airflow-scheduler"]["volumes"]
    assert "checkpoints:/checkpoints" in services["ray-head"]["volumes"]


def test_compose_config_without_env_names_the_missing_secret() -> None:
    with pytest.raises(ComposeError, match=r"^required variable \w+ is missing a value: set it in docker/.env$"):
        render(COMPOSE, {})


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda c: c["services"]["mlflow"].update(depends_on={"postgress": {}}), "no service 'postgress'"),
        (lambda c: c["services"]["mlflow"].update(volumes=["mlruns:/mlruns"]), "named volume 'mlruns'"),
        (lambda c: c["services"]["mlflow"]["build"].update(dockerfile="nope.Dockerfile"), "does not exist"),
        (lambda c: c["services"]["mlflow"].update(prots=[]), "unsupported keys ['prots']"),
    ],
)
def test_compose_config_rejects_a_broken_file(tmp_path: Path, edit: Any, problem: str) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    edit(compose)
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    with pytest.raises(ComposeError) as exc:
        render(broken, read_env_file(ROOT / "docker/.env.example"), project_dir=ROOT / "docker")
    assert problem in str(exc.value)


def _preamble(dockerfile: Path) -> tuple[list[str], str]:
    """The global ``ARG`` lines before the first ``FROM``, and that ``FROM`` line (continuations joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.upper().startswith("ARG "):
            args.append(stripped)
        elif stripped.upper().startswith("FROM "):
            return args, stripped
    raise AssertionError(f"{dockerfile.name} has no FROM")


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_takes_its_base_image_as_build_argument(name: str) -> None:
    args, first_from = _preamble(ROOT / "docker" / name)
    assert first_from.split()[1] == "${BASE_IMAGE}", first_from
    defaults = dict(a.split(None, 1)[1].split("=", 1) for a in args if "=" in a)
    assert defaults["BASE_IMAGE"] == DOCKERFILES[name]


def _podman_ready() -> str | None:
    """None when podman runs containers from the local base here; else why not (after trying to set it up)."""
    setup = ROOT / "docker/podman-setup.sh"
    check = subprocess.run(["bash", str(setup), "--check"], capture_output=True, text=True)
    if check.returncode == 0:
        return None
    if os.geteuid() != 0:
        return f"{check.stdout.strip()} (and not root, so it cannot be installed here)"
    # setup_env.sh runs this too; a fresh machine that skipped it installs podman and the base now (~1 min).
    made = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    if made.returncode != 0:
        return f"podman cannot be set up here: {(made.stderr or made.stdout).strip().splitlines()[-1]}"
    return None


@pytest.fixture(scope="module")
def podman() -> str:
    reason = _podman_ready()
    if reason:
        pytest.skip(reason)
    return shutil.which("podman") or "podman"


@pytest.mark.parametrize("name", sorted(set(DOCKERFILES) - {"worker.Dockerfile"}))
def test_first_stage_builds_from_the_local_base(podman: str, name: str, tmp_path: Path) -> None:
    args, first_from = _preamble(ROOT / "docker" / name)
    (tmp_path / "Dockerfile").write_text("\n".join([*args, first_from, "RUN test -x /bin/bash", ""]))
    tag = f"localhost/rlhf-ops-test/first-stage:{uuid.uuid4().hex[:8]}"
    try:
        built = subprocess.run(
            [podman, "build", "-q", "--network", "host", "--build-arg", f"BASE_IMAGE={LOCAL_BASE}", "-t", tag, "."],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stderr
        # The built image's first layer is the local base's: the build argument really replaced the default.
        layers = subprocess.run(
            [podman, "image", "inspect", "--format", "{{index .RootFS.Layers 0}}", tag, LOCAL_BASE],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert layers[0] == layers[1]
    finally:
        subprocess.run([podman, "rmi", "-f", tag], capture_output=True)


def _stack(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts/stack.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.fixture
def stack_env(podman: str) -> Iterator[dict[str, str]]:
    """A stack name of its own (its label, containers and volumes), on a port range nothing else uses."""
    name = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    env = {"RLHF_STACK_NAME": name, "RLHF_STACK_PORT_BASE": "28400"}
    yield env
    names = subprocess.run(
        [podman, "ps", "-aq", "--filter", f"name={name}"], capture_output=True, text=True
    ).stdout.split()
    if names:
        subprocess.run([podman, "rm", "-f", *names], capture_output=True)
    volumes = subprocess.run(
        [podman, "volume", "ls", "-q", "--filter", f"name={name}"], capture_output=True, text=True
    ).stdout.split()
    if volumes:
        subprocess.run([podman, "volume", "rm", "-f", *volumes], capture_output=True)
    shutil.rmtree(ROOT / ".rlhf" / name, ignore_errors=True)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_stack_up_without_the_base_image_says_how_to_make_it(stack_env: dict[str, str]) -> None:
    line = _one_line(_stack("up", env={**stack_env, "RLHF_STACK_BASE_IMAGE": "local/no-such-base:1"}))
    assert line == (
        "stack: base image local/no-such-base:1 not found: run bash docker/podman-setup.sh, "
        "or set RLHF_STACK_BASE_IMAGE"
    )


def test_stack_up_refuses_a_taken_port(stack_env: dict[str, str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 28400 + 13))  # the MLflow port of that range
        sock.listen()
        line = _one_line(_stack("up", env=stack_env))
    assert line.startswith("stack: port 28413 (range 28400-28499) is in use by another process")
    assert line.endswith("set RLHF_STACK_PORT_BASE to another free range")


def test_stack_up_refuses_a_second_stack_and_down_removes_only_its_own(podman: str, stack_env: dict[str, str]) -> None:
    name = stack_env["RLHF_STACK_NAME"]
    label = f"rlhf-ops.stack={name}"
    mine = f"{name}-postgres"
    other = f"{name}-not-mine"  # same name prefix, no label: must survive `down`
    for container, extra in ((mine, ["--label", label]), (other, [])):
        created = [podman, "create", "--name", container, *extra, LOCAL_BASE, "true"]
        subprocess.run(created, check=True, capture_output=True)
    subprocess.run([podman, "volume", "create", "--label", label, f"{name}-work"], check=True, capture_output=True)
    subprocess.run([podman, "volume", "create", f"{name}-keep"], check=True, capture_output=True)

    line = _one_line(_stack("up", env=stack_env))
    assert line == f"stack: the stack is already up ({mine}): bash scripts/stack.sh status, or down first"

    down = _stack("down", env=stack_env)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stack: down (1 containers, 1 volumes removed)"
    containers = subprocess.run(
        [podman, "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}"], capture_output=True, text=True
    ).stdout.split()
    volumes = subprocess.run(
        [podman, "volume", "ls", "--filter", f"name={name}", "--format", "{{.Name}}"], capture_output=True, text=True
    ).stdout.split()
    assert containers == [other]
    assert volumes == [f"{name}-keep"]


def test_stack_status_names_a_container_that_exited(podman: str, stack_env: dict[str, str]) -> None:
    name = stack_env["RLHF_STACK_NAME"]
    label = f"rlhf-ops.stack={name}"
    crashed = f"{name}-mlflow"
    script = "echo starting; echo 'Error: no such option --wokers' >&2; exit 3"
    run = [podman, "run", "--name", crashed, "--label", label, "--network", "host", LOCAL_BASE, "bash", "-c", script]
    subprocess.run(run, capture_output=True)
    status = _stack("status", env=stack_env)
    assert status.returncode == 1
    assert crashed in status.stdout  # the table still lists it
    lines = [line for line in status.stderr.splitlines() if line.strip()]
    assert lines == [
        f"stack: container {crashed} exited (code 3, state exited): Error: no such option --wokers; "
        f"full log: podman logs {crashed}"
    ]


def test_stack_unknown_command_prints_the_usage() -> None:
    line = _one_line(_stack("launch", env={}))
    assert line == "stack: usage: bash scripts/stack.sh build|up|down|status|trigger [CONF_JSON]"


def test_every_postgresql_url_names_the_driver_the_airflow_image_installs() -> None:
    """The lock's SQLAlchemy (2.1) reads a bare ``postgresql://`` as psycopg 3, which the Airflow image does not
    install: a Celery result backend without ``+psycopg2`` stopped the worker at start-up (the Celery provider
    reports that ImportError as "Failed to import providers_configuration_loaded")."""
    from sqlalchemy.engine import make_url

    files = [ROOT / "scripts/stack.sh", COMPOSE, *sorted((ROOT / "docker/k8s").glob("*.yaml"))]
    schemes = {s for f in files for s in re.findall(r"\bpostgresql(?:\+\w+)?://", f.read_text())}
    assert schemes, "no PostgreSQL URL found: the pattern no longer matches the deployment files"
    drivers = {s: make_url(f"{s}user@host/db").get_dialect().driver for s in schemes}
    assert set(drivers.values()) == {"psycopg2"}, drivers
    assert re.search(
        r"pip install [^\n]*\\\n(?:[^\n]*\\\n)*[^\n]*psycopg2-binary",
        ROOT.joinpath("docker/airflow.Dockerfile").read_text(),
    ), "the Airflow image no longer installs psycopg2-binary"
