"""The pipeline's tracking steps against a real MLflow server: start/end of the run, warm start from the champion."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from rlhf_ops.pipeline.job_results import read_result
from rlhf_ops.pipeline.jobs import run_job
from rlhf_ops.pipeline.layout import run_key
from rlhf_ops.pipeline.register import download_champion
from rlhf_ops.pipeline.tracking import end_tracking, start_tracking
from rlhf_ops.tracking.mlflow_tracking import MlflowLogger
from rlhf_ops.tracking.registry import move_alias, register_candidate
from tests.support.mlflow_server import mlflow_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CONFIG = {
    "algorithm": {"adv_estimator": "grpo"},
    "tracking": {"experiment": "pipeline-it"},
    "actor": {"lr": 1e-3},
    "model": {"path": "builtin:tiny-llama"},
}


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


TRAIN_SHA, VAL_SHA = "aa" + "0" * 62, "bb" + "1" * 62


def _prepared(tmp_path: Path) -> dict[str, str]:
    files = {"val.parquet": {"sha256": VAL_SHA, "num_rows": 2}, "train.parquet": {"sha256": TRAIN_SHA, "num_rows": 3}}
    (tmp_path / "manifest.json").write_text(json.dumps({"version": 1, "counts": {"train": 3}, "files": files}))
    rows = [{"row_index": i, "reason": "prompt too long"} for i in range(150)]
    (tmp_path / "rejected.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "run_id": "manual__1-0a1b",
        "manifest_url": str(tmp_path / "manifest.json"),
        "rejected_url": str(tmp_path / "rejected.jsonl"),
        "train_url": "s3://data/manual__1-0a1b/train.parquet",
        "val_url": "webhdfs://user:secret@nn:9870/data/manual__1-0a1b/val.parquet",
    }


def test_start_tracking_is_idempotent_and_logs_what_is_known(tracking_uri: str, tmp_path: Path) -> None:
    kwargs = {
        "config": CONFIG,
        "preset": "tiny-cpu",
        "dag_id": "rlhf_ppo",
        "dag_run_id": "manual__1",
        "run_date": dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.UTC),
        "prepared": _prepared(tmp_path),
        "tracking_uri": tracking_uri,
    }
    first = start_tracking(try_number=1, **kwargs)
    second = start_tracking(try_number=2, **kwargs)  # a retried task finds the same run
    run_id = first["mlflow_run_id"]
    assert second["mlflow_run_id"] == run_id
    assert first["mlflow_run_url"] == f"{tracking_uri}/#/experiments/{first['mlflow_experiment_id']}/runs/{run_id}"
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    # the minute plus the digest of the Airflow run id (run_key("manual__1") ends with it): unique per run
    assert run.info.run_name == f"tiny-cpu/grpo/2026-11-29T10:00/{run_key('manual__1')[-8:]}"
    assert run.data.params["actor.lr"] == "0.001"
    assert run.data.tags["airflow.try_number"] == "2" and run.data.tags["rlhf.preset"] == "tiny-cpu"
    # What the compare view tells two runs apart by, as params (its parameter table) and tags.
    data_sha = hashlib.sha256(f"train.parquet:{TRAIN_SHA}\nval.parquet:{VAL_SHA}".encode()).hexdigest()
    params = run.data.params
    assert (params["pipeline.preset"], params["pipeline.algorithm"]) == ("tiny-cpu", "grpo")
    assert params["pipeline.model"] == "builtin:tiny-llama" and params["pipeline.data_sha256"] == data_sha
    assert params["pipeline.dag_run"] == "rlhf_ppo/manual__1"
    assert params["pipeline.platform_commit"] == run.data.tags["rlhf.git_commit"] != ""
    assert run.data.tags["rlhf.data_sha256"] == data_sha and run.data.tags["rlhf.model"] == "builtin:tiny-llama"
    # The prepared files as dataset inputs: source URL (credentials masked), digest = the file's sha256 prefix.
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}  # a retry logged the same two again
    assert len(run.inputs.dataset_inputs) == 2 and set(inputs) == {"training", "validation"}
    train, val = inputs["training"], inputs["validation"]
    assert (train.name, train.digest, train.source_type) == ("manual__1-0a1b/train", TRAIN_SHA[:16], "s3")
    assert json.loads(train.source) == {"uri": "s3://data/manual__1-0a1b/train.parquet"}
    assert (val.name, val.digest, val.source_type) == ("manual__1-0a1b/val", VAL_SHA[:16], "http")
    assert json.loads(val.source) == {"url": "webhdfs://user:***@nn:9870/data/manual__1-0a1b/val.parquet"}
    rejected = client.download_artifacts(run_id, "data/rejected_sample.jsonl", str(tmp_path / "dl"))
    assert len(Path(rejected).read_text().splitlines()) == 100  # a sample, not all 150
    assert end_tracking(run_id=run_id, failed=True, tags={"ray.submission_id": "af-x"}, tracking_uri=tracking_uri) == (
        "FAILED"
    )
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["ray.submission_id"] == "af-x"


def _register_champion(tracking_uri: str, name: str, files: dict[str, bytes], folder: Path) -> None:
    """Log ``files`` as a model folder of a new run, register it as version 1 of ``name`` and make it the champion."""
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment(f"{name}-exp")).info.run_id
    folder.mkdir()
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    model_uri = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False).log_model_dir(folder)
    assert model_uri is not None
    version, champion = register_candidate(
        run_id=run_id,
        model_uri=model_uri,
        registered_name=name,
        metric_name="eval/acc",
        metric_value=0.5,
        tracking_uri=tracking_uri,
    )
    assert (version.version, champion) == ("1", None)
    move_alias(registered_name=name, version="1", previous=None, tracking_uri=tracking_uri)


def test_warm_start_downloads_the_champion_once(tracking_uri: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    assert download_champion("pipeline-it-model", models_dir=str(models), tracking_uri=tracking_uri) is None
    hf = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 16}
    _register_champion(tracking_uri, "pipeline-it-model", hf, tmp_path / "hf")
    folder = download_champion("pipeline-it-model", models_dir=str(models), tracking_uri=tracking_uri)
    assert folder is not None and Path(folder, "config.json").read_text() == '{"model_type": "llama"}'
    assert Path(folder).is_relative_to(models / "pipeline-it-model" / "v1")
    Path(folder, "model.safetensors").write_bytes(b"kept")  # a second call reuses the folder, downloads nothing
    assert download_champion("pipeline-it-model", models_dir=str(models), tracking_uri=tracking_uri) == folder
    assert Path(folder, "model.safetensors").read_bytes() == b"kept"


def test_fetch_champion_job_downloads_the_champion_into_the_work_folder_and_writes_its_result(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)  # as RayTaskJobOperator passes mlflow_default
    from rlhf_ops.pipeline.heavy.fetch_champion import FetchChampionRequest
    from rlhf_ops.pipeline.job_requests import RunRef

    run = RunRef(
        dag_id="fetch_dag", run_id="manual__1", work_dir=str(tmp_path / "work"), remote_store_url=tmp_path.as_uri()
    )
    layout = run.layout()

    def job(name: str, submission_id: str) -> dict[str, Any]:
        request = FetchChampionRequest(run=run, registered_name=name)
        env = {"RLHF_SUBMISSION_ID": submission_id, "RLHF_JOB_REQUEST": request.model_dump_json()}
        code = run_job("fetch_champion", environ=env)
        result = read_result(submission_id, remote_run_url=run.remote_run_url, logs=lambda: "")
        assert result is not None and code == (0 if result["status"] == "ok" else 2), (code, result)
        return result

    # The first run of a pipeline: no champion yet, preflight keeps the preset's model.
    none = job("fetch-it-model", "af-first")
    assert none == {"status": "ok", "value": {"registered_name": "fetch-it-model", "version": None, "model_dir": None}}
    weights = bytes(range(256)) * 4
    hf = {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights, "tokenizer.json": b"{}"}
    _register_champion(tracking_uri, "fetch-it-model", hf, tmp_path / "hf")
    value = job("fetch-it-model", "af-second")["value"]
    version_dir = Path(layout.models_dir) / "fetch-it-model" / "v1"
    assert value["version"] == "1" and value["registered_name"] == "fetch-it-model"
    model_dir = Path(value["model_dir"])
    assert model_dir.is_relative_to(version_dir)  # <work>/models/<name>/v<version>/...: keyed by version
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == hf  # the registered files, byte for byte
    assert (version_dir / ".complete").read_text() == "fetch-it-model v1\n"
    assert [p.name for p in version_dir.parent.iterdir()] == ["v1"]  # no temporary download left beside it
    assert job("fetch-it-model", "af-second-retry")["value"] == value  # a retry reuses the folder

    # A champion that is no HF model folder: a mistake no retry fixes, as a non-retryable error result.
    _register_champion(tracking_uri, "fetch-bad-model", {"weights.bin": b"x"}, tmp_path / "bad")
    bad = job("fetch-bad-model", "af-bad")
    assert (bad["status"], bad["retryable"]) == ("error", False)
    assert bad["error"] == "fetch-bad-model v1 has no config.json; register an HF model folder"
