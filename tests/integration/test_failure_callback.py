"""A task that fails for good leaves a failure summary in the task log and on the pipeline's MLflow run.

A real Airflow (SQLite DB, ``dag.test()``) runs a two-task DAG: ``start_tracking`` opens a real MLflow run and
pushes its id and URL as the pipeline's task does; ``train`` fails with a two-line error. The factory's
``on_failure_callback`` (:func:`rlhf_pipeline.callbacks.on_task_failure`) must tag the run with the task, the
first line of the error and the links.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env, migrate_airflow_db

configure_airflow_env()  # before anything imports airflow

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.support.mlflow_server import mlflow_server  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
DAG_FILE = """
import pendulum
from functools import partial
from airflow.sdk import DAG, task
from rlhf_pipeline.callbacks import on_task_failure

with DAG("failing_pipeline", schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False,
         default_args={"retries": 0, "on_failure_callback": partial(on_task_failure, mlflow_conn_id="mlflow_default")},
         ):

    @task(task_id="start_tracking", multiple_outputs=True)
    def start_tracking():
        import os
        from mlflow import MlflowClient
        client = MlflowClient(os.environ["TEST_MLFLOW_URI"])
        run = client.create_run(client.create_experiment("failure-it"))
        return {"mlflow_run_id": run.info.run_id, "mlflow_run_url": f"http://mlflow.example/runs/{run.info.run_id}"}

    @task(task_id="train")
    def train(tracking):
        raise ValueError("Ray job af-123 FAILED: exit code 2\\nTraceback (most recent call last): ...")

    train(start_tracking())
"""


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


def test_failed_task_tags_the_mlflow_run(tracking_uri: str) -> None:
    migrate_airflow_db()
    dags = configure_airflow_env() / "dags"
    shutil.copytree(ROOT / "dags" / "rlhf_pipeline", dags / "rlhf_pipeline", dirs_exist_ok=True)
    (dags / "failing_pipeline.py").write_text(DAG_FILE)
    os.environ["TEST_MLFLOW_URI"] = tracking_uri
    os.environ["AIRFLOW_CONN_MLFLOW_DEFAULT"] = json.dumps({"conn_type": "http", "host": tracking_uri})
    from airflow.dag_processing.dagbag import BundleDagBag
    from mlflow import MlflowClient

    bag = BundleDagBag(dag_folder=str(dags), bundle_path=str(dags), bundle_name="dags-folder")
    assert not bag.import_errors, bag.import_errors
    dag_run = bag.dags["failing_pipeline"].test()
    assert str(dag_run.state) == "failed"
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("failure-it").experiment_id])
    summary = run.data.tags["rlhf.failure"]
    assert run.data.tags["rlhf.failed_task"] == "train"
    lines = summary.splitlines()
    assert lines[0] == f"failing_pipeline / {dag_run.run_id}: train failed (try 1)"
    assert lines[1] == "error: ValueError: Ray job af-123 FAILED: exit code 2"
    assert lines[2] == f"MLflow run: http://mlflow.example/runs/{run.info.run_id}"
    assert (
        lines[3].startswith("log: http") and "/dags/failing_pipeline/runs/" in lines[3] and "/tasks/train" in lines[3]
    )
