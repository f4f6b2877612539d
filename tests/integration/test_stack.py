"""The deployment on this machine: ``scripts/stack.sh`` builds the images (reused when their inputs did not
change), starts the whole stack in podman containers, and ``rlhf_ppo`` triggered through the Airflow REST API
runs end to end across them on tiny-cpu (4 steps, a checkpoint every 2): training as a Ray job on the
containerised Ray cluster, and so are the torch tasks (prepare_data, evaluate_checkpoint, register_model),
checkpoints and ``eval.json`` in the moto S3 container, the model registered in the MLflow container. Then
``down`` leaves no container or volume of the stack behind.

First run on a machine: ~20-25 minutes of image builds (2 cores); with the images built, ~10 minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".rlhf" / "rlhf-stack"
PORT_BASE = 28700
S3 = f"http://127.0.0.1:{PORT_BASE + 12}"
MLFLOW = f"http://127.0.0.1:{PORT_BASE + 13}"
BUCKET = "rlhf-checkpoints"


def _stack(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RLHF_STACK_PORT_BASE": str(PORT_BASE)}
    return subprocess.run(
        ["bash", str(ROOT / "scripts/stack.sh"), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _labelled(kind: str) -> list[str]:
    cmd = ["podman", "ps", "-a"] if kind == "container" else ["podman", "volume", "ls"]
    out = subprocess.run([*cmd, "--filter", "label=rlhf-ops.stack=rlhf-stack", "-q"], capture_output=True, text=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    check = subprocess.run(["bash", str(ROOT / "docker/podman-setup.sh"), "--check"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.skip(check.stdout.strip())
    if _labelled("container"):
        pytest.skip("a stack is already up on this machine (bash scripts/stack.sh down to free it)")
    up = _stack("up", timeout=3000)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        yield
    finally:
        down = _stack("down", timeout=300)
        assert down.returncode == 0, down.stderr
        assert _labelled("container") == [] and _labelled("volume") == []


@pytest.fixture(scope="module")
def pipeline(stack: None) -> dict[str, Any]:
    run = _stack("trigger", timeout=2400)
    assert run.stdout.strip(), run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    # A failed task's exception, one line each (its whole log is kept under .rlhf/rlhf-stack/logs/failed/).
    result["failures"] = [line for line in run.stderr.splitlines() if line.startswith("stack: failed ")]
    return result


def test_images_are_reused_when_inputs_did_not_change(stack: None) -> None:
    again = _stack("build", timeout=600)
    assert again.returncode == 0, again.stderr
    reused = re.findall(r"image rlhf-ops/([\w-]+):([0-9a-f]{16}) is up to date", again.stderr)
    assert sorted(name for name, _ in reused) == ["airflow", "mlflow", "services", "worker-cpu"], again.stderr
    # The containers run the content-hash tags the rebuild just found up to date.
    running = subprocess.run(
        ["podman", "ps", "--filter", "label=rlhf-ops.stack=rlhf-stack", "--format", "{{.Image}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {ref.removeprefix("localhost/") for ref in running} == {f"rlhf-ops/{n}:{d}" for n, d in reused}


def test_airflow_image_has_no_torch(stack: None) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'vllm', 'transformers') if u.find_spec(m)])"
    out = subprocess.run(
        ["podman", "exec", "rlhf-stack-airflow-scheduler", "python", "-c", probe], capture_output=True, text=True
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_pipeline_runs_every_task_across_the_containers(pipeline: dict[str, Any]) -> None:
    tasks = dict(pipeline["tasks"])
    assert pipeline["state"] == "success", (tasks, pipeline["failures"])
    assert tasks.pop("fetch_champion") == "skipped", tasks  # warm_start: scratch
    assert set(tasks.values()) == {"success"}, tasks
    # one evaluation per planned checkpoint (steps 2 and 4)
    assert {t for t in tasks if t.startswith("evaluate.evaluate_checkpoint")} == {
        "evaluate.evaluate_checkpoint[0]",
        "evaluate.evaluate_checkpoint[1]",
    }


def _s3() -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=S3, region_name="us-east-1", aws_access_key_id="stack", aws_secret_access_key="stack"
    )


def test_checkpoints_and_evaluations_in_s3(pipeline: dict[str, Any]) -> None:
    from rlhf_ops.pipeline.layout import run_key

    prefix = f"runs/rlhf_ppo/{run_key(pipeline['dag_run_id'])}/"
    pages = _s3().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    keys = {o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])}
    # the last checkpoint is always kept by retention, with its evaluation beside it
    assert {"global_step_4/MANIFEST.json", "global_step_4/eval.json", "latest"} <= keys, sorted(keys)
    latest = _s3().get_object(Bucket=BUCKET, Key=prefix + "latest")["Body"].read().decode()
    assert latest == "global_step_4"
    report = json.loads(_s3().get_object(Bucket=BUCKET, Key=prefix + "global_step_4/eval.json")["Body"].read())
    assert report["step"] == 4 and report["metrics"]["eval/num_prompts"] == 32.0


def test_model_registered_in_mlflow(pipeline: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(MLFLOW)
    champion = client.get_model_version_by_alias("rlhf_ppo-tiny-cpu", "champion")
    assert champion.run_id is not None
    run = client.get_run(champion.run_id)
    assert run.data.tags["airflow.run_id"] == pipeline["dag_run_id"]
    assert run.info.status == "FINISHED"
    history = {m.step for m in client.get_metric_history(champion.run_id, "eval/reward/mean")}
    assert history == {2, 4}
    assert [m.step for m in client.get_metric_history(champion.run_id, "actor/pg_loss")] == [1, 2, 3, 4]
    files = {a.path for a in client.list_artifacts(champion.run_id, "model")}  # an MLflow Model (transformers)
    assert {"model/MLmodel", "model/model"} <= files
    files = {a.path for a in client.list_artifacts(champion.run_id, "model/model")}  # the HF folder inside it
    assert {"model/model/config.json", "model/model/model.safetensors", "model/model/README.md"} <= files
