"""Tracking against a real ``mlflow server`` (SQLite + proxied file artifacts): runs, params, metrics,
artifacts, a second process attaching to the run, rank gating and the champion alias."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from rlhf_ops.tracking import artifacts
from rlhf_ops.tracking.mlflow_tracking import (
    MlflowLogger,
    end_pipeline_run,
    pipeline_tags,
    run_name_for,
    start_pipeline_run,
)
from rlhf_ops.tracking.params import OVERFLOW_ARTIFACT, REDACTED
from rlhf_ops.tracking.registry import TAG_PREVIOUS_CHAMPION, download_model, move_alias, register_candidate
from tests.support.mlflow_server import mlflow_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXPERIMENT = "rlhf-tracking-it"
TEMPLATE = "{% for m in messages %}" + "x" * 10_000 + "{% endfor %}"  # 10,036 chars > 6000: overflows


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


@pytest.fixture(scope="module")
def client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri)


def _new_run(tracking_uri: str, dag_run_id: str) -> str:
    return start_pipeline_run(
        tracking_uri=tracking_uri,
        experiment=EXPERIMENT,
        run_name=run_name_for("tiny-cpu", "grpo", dt.datetime(2026, 11, 29, 10, 0)),
        tags=pipeline_tags(dag_id="rlhf_grpo", dag_run_id=dag_run_id, try_number=1),
    )


def _config() -> dict[str, object]:
    return {
        "actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.95]}, "ppo_mini_batch_size": 8, "use_kl_loss": True},
        "data": {"train_files": ["s3://bucket/train.parquet"], "prompt_key": "prompt", "chat_template": TEMPLATE},
        "storage": {"url": "s3://minio:secret@minio:9000/ckpt", "password": "hunter2"},
        "sweep": {f"k{i:03d}": i for i in range(250)},  # 250 + 9 params: 3 log_batch requests of <= 100
    }


def test_pipeline_run_params_metrics_tags_artifacts(tracking_uri: str, client: MlflowClient, tmp_path: Path) -> None:
    run_id = _new_run(tracking_uri, "manual__it_1")
    # An Airflow retry of start_tracking finds the same run and records the new try number.
    retry_tags = pipeline_tags(dag_id="rlhf_grpo", dag_run_id="manual__it_1", try_number=2, ray_submission_id="rlhf-1")
    again = start_pipeline_run(tracking_uri=tracking_uri, experiment=EXPERIMENT, run_name="ignored", tags=retry_tags)
    assert again == run_id

    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, system_metrics_interval_s=0.5)
    logger.log_params(_config())
    for step in range(1, 6):
        metrics = {"actor/pg_loss": 1.0 / step, "timing_s/gen": torch.tensor(0.5 * step), "val-core/acc@1": 0.1}
        logger.log_metrics(metrics, step=step)
    logger.log_metrics({"actor/grad_norm": float("nan")}, step=5)
    artifacts.log_resolved_config(logger, _config())
    artifacts.log_generations(logger, [{"prompt": "1+1=", "response": "2", "score": 1.0}], step=5)
    artifacts.log_eval_report(logger, {"val/acc": 0.75}, step=5)
    logger.log_text("hello", "notes/readme.txt")
    deadline = time.monotonic() + 20  # the monitor samples every 0.5 s; wait for its first publish
    while (
        not any(k.startswith("system/") for k in client.get_run(run_id).data.metrics) and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    logger.close()

    run = client.get_run(run_id)
    params, tags = run.data.params, run.data.tags
    assert len(params) == 259  # 4 actor + 3 data + 2 storage + 250 sweep
    assert params["actor.optim.lr"] == "1e-06" and params["actor.optim.betas"] == "[0.9, 0.95]"
    assert params["data.prompt_key"] == "prompt" and params["sweep.k249"] == "249"
    assert params["storage.password"] == REDACTED
    assert params["storage.url"] == "s3://minio:***@minio:9000/ckpt"
    assert params["data.chat_template"].startswith(f"<in {OVERFLOW_ARTIFACT}: {len(TEMPLATE)} chars")
    overflow = json.loads(Path(client.download_artifacts(run_id, OVERFLOW_ARTIFACT, str(tmp_path))).read_text())
    assert overflow == {"data.chat_template": TEMPLATE}

    history = client.get_metric_history(run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1.0 / 3),
        (4, 0.25),
        (5, 0.2),
    ]
    gen = sorted(client.get_metric_history(run_id, "timing_s/gen"), key=lambda m: m.step)
    assert [m.value for m in gen] == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert run.data.metrics["val-core/acc_1"] == 0.1
    assert math.isnan(run.data.metrics["actor/grad_norm"])  # MLflow keeps NaN
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)

    assert tags["airflow.dag_id"] == "rlhf_grpo" and tags["airflow.run_id"] == "manual__it_1"
    assert tags["airflow.try_number"] == "2" and tags["ray.submission_id"] == "rlhf-1"
    assert tags["mlflow.runName"] == "tiny-cpu/grpo/2026-11-29T10:00"
    assert tags["rlhf.git_commit"]

    _check_artifacts(client, run_id, tmp_path)


def _check_artifacts(client: MlflowClient, run_id: str, tmp_path: Path) -> None:
    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"config", "eval", "generations", "notes", OVERFLOW_ARTIFACT}
    config_text = Path(client.download_artifacts(run_id, artifacts.CONFIG_ARTIFACT, str(tmp_path))).read_text()
    assert "hunter2" not in config_text and "secret@" not in config_text and "lr: 1.0e-06" in config_text
    table = json.loads(
        Path(client.download_artifacts(run_id, "generations/step_000005.json", str(tmp_path))).read_text()
    )
    assert table == {"columns": ["prompt", "response", "score"], "data": [["1+1=", "2", 1.0]]}


def test_second_process_attaches_via_env_and_reopens_a_finished_run(tracking_uri: str, client: MlflowClient) -> None:
    run_id = _new_run(tracking_uri, "manual__it_attach")
    end_pipeline_run(tracking_uri=tracking_uri, run_id=run_id, status="FAILED")  # the previous try failed
    code = (
        "from rlhf_ops.tracking.mlflow_tracking import MlflowLogger\n"
        "lg = MlflowLogger(log_system_metrics=False)\n"
        "lg.log_metrics({'actor/pg_loss': 1 / 6}, step=6)\n"
        "lg.close()\n"
    )
    env = {**os.environ, "MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": tracking_uri, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # attaching resumed the run
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "actor/pg_loss")] == [(6, 1 / 6)]
    end_pipeline_run(tracking_uri=tracking_uri, run_id=run_id)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_non_zero_rank_logs_nothing(tracking_uri: str, client: MlflowClient) -> None:
    run_id = _new_run(tracking_uri, "manual__it_rank1")
    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, rank=1)
    logger.log_params({"a": 1})
    logger.log_metrics({"actor/pg_loss": 1.0}, step=1)
    logger.log_text("x", "x.txt")
    logger.close()
    run = client.get_run(run_id)
    assert run.data.params == {} and run.data.metrics == {}
    assert client.list_artifacts(run_id) == []


def _model_run(tracking_uri: str, tmp_path: Path, name: str) -> tuple[str, str]:
    run_id = _new_run(tracking_uri, f"manual__it_{name}")
    hf_dir = tmp_path / name
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "qwen2", "name": name}))
    (hf_dir / "model.safetensors").write_bytes(b"\0" * 16)
    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False)
    model_uri = logger.log_model_dir(hf_dir)
    logger.close()
    assert model_uri == f"runs:/{run_id}/model"
    return run_id, model_uri


def test_every_model_is_registered_once_and_the_alias_moves_when_told(
    tracking_uri: str, client: MlflowClient, tmp_path: Path
) -> None:
    # The registry calls of the pipeline's promotion (rlhf_ops.pipeline.champion decides; these record).
    name = "tiny-policy"

    def register(run_id: str, model_uri: str, value: float) -> tuple[str, str | None]:
        version, champion = register_candidate(
            run_id=run_id,
            model_uri=model_uri,
            registered_name=name,
            metric_name="val/acc",
            metric_value=value,
            tracking_uri=tracking_uri,
        )
        return str(version.version), None if champion is None else str(champion.version)

    first, worse, better = (_model_run(tracking_uri, tmp_path, n) for n in ("first", "worse", "better"))
    assert register(*first, 0.5) == ("1", None)  # no champion yet
    move_alias(registered_name=name, version="1", previous=None, tracking_uri=tracking_uri)
    assert register(*worse, 0.4) == ("2", "1")  # registered; the alias stays on v1 unless moved
    assert register(*worse, 0.4) == ("2", "1")  # a retried task reuses v2
    assert client.get_model_version_by_alias(name, "champion").version == "1"
    assert register(*first, 0.5) == ("1", "1")  # retry of the champion's own registration
    assert register(*better, 0.7) == ("3", "1")
    move_alias(registered_name=name, version="3", previous="1", tracking_uri=tracking_uri)

    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.version == "3" and champion.source == better[1]
    assert champion.tags["rlhf.eval_metric_value"] == "0.7" and champion.tags[TAG_PREVIOUS_CHAMPION] == "1"
    assert champion.tags["rlhf.promoted"] == "true"
    assert client.get_model_version(name, "2").tags["rlhf.promoted"] == "false"
    assert len(client.search_model_versions(f"name = '{name}'")) == 3

    local = download_model(registered_name=name, dst_path=tmp_path / "dl", tracking_uri=tracking_uri)
    assert json.loads((local / "config.json").read_text())["name"] == "better"
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]


def test_models_uri_download_with_env_tracking_uri(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, model_uri = _model_run(tracking_uri, tmp_path, "env")
    version, champion = register_candidate(
        run_id=run_id,
        model_uri=model_uri,
        registered_name="env-policy",
        metric_name="val/loss",
        metric_value=1.5,
        tracking_uri=tracking_uri,
    )
    assert (version.version, champion) == ("1", None)
    move_alias(registered_name="env-policy", version="1", previous=None, tracking_uri=tracking_uri)
    import mlflow.artifacts

    # models:/ resolution reads the global registry URI (it ignores registry_uri=), so consumers set the env var.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    local = mlflow.artifacts.download_artifacts("models:/env-policy@champion", dst_path=str(tmp_path / "dl"))
    assert json.loads((Path(local) / "config.json").read_text())["name"] == "env"
