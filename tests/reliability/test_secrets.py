"""Secrets never reach what the platform writes: realistic AWS keys, a Ray token and an MLflow password in the
environment and in config values, through the real pre-training tracking path (``start_tracking``: params,
tags, resolved config, data manifest, rejected sample) into a real MLflow store, then a byte scan of the store.

The whole pipeline (XCom, task logs, Ray job logs, checkpoints) is scanned by the slow
``tests/reliability/test_secrets_pipeline.py``.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.parse
from pathlib import Path

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.tracking.params import redact_value
from tests.reliability.conftest import Figures

# Shaped like the real ones (AWS documents this example pair; the others are random of the real lengths).
AWS_KEY_ID = "AKIAJ7Q2X4K9LMN3PQRS"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzQ8r+Vb1Xk"
RAY_TOKEN = "rt_6f1c2b9e4d7a8c3f0e5b1a9d2c7e4f8a"
MLFLOW_PASSWORD = "Mlf0w-S3cr3t-pa55!x"
SECRETS = {"aws_key_id": AWS_KEY_ID, "aws_secret": AWS_SECRET, "ray_token": RAY_TOKEN, "mlflow_pw": MLFLOW_PASSWORD}


def secret_environ() -> dict[str, str]:
    """The environment (and Airflow connections) a deployment holds these secrets in."""
    return {
        "AWS_ACCESS_KEY_ID": AWS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "RAY_AUTH_TOKEN": RAY_TOKEN,
        "MLFLOW_TRACKING_USERNAME": "mlflow-admin",
        "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps({"conn_type": "aws", "login": AWS_KEY_ID, "password": AWS_SECRET}),
        "AIRFLOW_CONN_RAY_DEFAULT": json.dumps({"conn_type": "ray", "host": "127.0.0.1", "password": RAY_TOKEN}),
    }


def scan(root: Path, secrets: dict[str, str] = SECRETS) -> dict[str, list[str]]:
    """``{secret name: [files holding it]}`` over every file under ``root`` (raw and percent-encoded forms)."""
    found: dict[str, list[str]] = {name: [] for name in secrets}
    forms = {name: {v.encode(), urllib.parse.quote(v, safe="").encode()} for name, v in secrets.items()}
    for path in (p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for name, variants in forms.items():
            if any(v in data for v in variants):
                found[name].append(str(path.relative_to(root)))
    return {name: files for name, files in found.items() if files}


@pytest.mark.parametrize(
    "value",
    [
        f"s3://{AWS_KEY_ID}:{AWS_SECRET}@bucket/runs",  # '/' and '+' inside the password
        f"s3://{AWS_KEY_ID}:{urllib.parse.quote(AWS_SECRET, safe='')}@bucket/runs",
        f"http://mlflow-admin:{MLFLOW_PASSWORD}@127.0.0.1:5000",
        f"ray://:{RAY_TOKEN}@head:10001",
        f"key {AWS_KEY_ID} in free text",
    ],
)
def test_credentials_in_values_are_masked(value: str) -> None:
    masked = redact_value(value)
    assert not any(secret in masked for secret in SECRETS.values()), masked
    assert not any(urllib.parse.quote(secret, safe="") in masked for secret in SECRETS.values()), masked


def test_tracking_path_writes_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Figures) -> None:
    from rlhf_ops.pipeline.tracking import start_tracking

    for key, value in secret_environ().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # the SQLite store's artifacts go to ./mlruns
    store = tmp_path / "store"
    store.mkdir()
    config = load_config(
        "tiny-cpu",
        [
            f"tracking.mlflow_uri=http://mlflow-admin:{MLFLOW_PASSWORD}@127.0.0.1:5000",
            f"trainer.remote_store_url=s3://{AWS_KEY_ID}:{urllib.parse.quote(AWS_SECRET, safe='')}@bucket/runs",
            f"resources.ray_address=ray://:{RAY_TOKEN}@head:10001",
        ],
    ).model_dump(mode="json")
    manifest = tmp_path / "data" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"source": f"s3://{AWS_KEY_ID}:{AWS_SECRET}@raw/rows.jsonl", "counts": {}}))
    rejected = tmp_path / "data" / "rejected.jsonl"
    rejected.write_text(json.dumps({"row_index": 0, "source": f"https://u:{MLFLOW_PASSWORD}@h/x", "row": "{}"}) + "\n")
    result = start_tracking(
        config=config,
        preset="tiny-cpu",
        dag_id="rlhf_ppo",
        dag_run_id="manual__secrets",
        try_number=1,
        run_date=dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        prepared={"manifest_url": str(manifest), "rejected_url": str(rejected)},
        extra_tags={"rlhf.checkpoint_url": f"s3://{AWS_KEY_ID}:{AWS_SECRET}@bucket/runs/x"},
        tracking_uri=f"sqlite:///{store}/mlflow.db",
    )
    from mlflow import MlflowClient

    run = MlflowClient(f"sqlite:///{store}/mlflow.db").get_run(result["mlflow_run_id"])
    assert run.data.params["tracking.mlflow_uri"] == "http://mlflow-admin:***@127.0.0.1:5000"
    assert len(run.data.params) > 100  # the whole config went through
    (tmp_path / "data").rename(tmp_path / "inputs")  # the inputs hold the secrets on purpose: not scanned
    found = {**scan(store), **scan(tmp_path / "mlruns")}
    figures.record(secrets=len(SECRETS), files_scanned=sum(1 for _ in tmp_path.rglob("*")), occurrences=len(found))
    assert found == {}
