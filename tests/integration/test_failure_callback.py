"""A task that fails for good leaves a failure summary in the task log and on the pipeline's MLflow run.

A real Airflow (SQLite DB, ``dag.test()``) runs a two-task DAG: ``start_tracking`` opens a real MLflow run and
pushes its id and URL as the pipeline's task does; ``train`` fails with a two-line error. The factory's
``on_failure_callback`` (:func:`rlhf_airflow.pipeline.callbacks.on_task_failure`) must tag the run with the task, the
first line of the error and the links, and write the summary to the DAG run's note through the REST API of a
real ``airflow api-server`` on the same metadata DB (the ``airflow_api`` connection: its URL and a user's
login / password).
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env, migrate_airflow_db

configure_airflow_env()  # before anything imports airflow

import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from rlhf_ops.pipeline.local_stack import free_ports  # noqa: E402
from tests.support.airflow_services import USERNAME, AirflowServices, component_env  # noqa: E402
from tests.support.mlflow_server import mlflow_server  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
DAG_FILE = """
import pendulum
from functools import partial
from airflow.sdk import DAG, task
from rlhf_airflow.pipeline.callbacks import on_task_failure

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


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowServices]:
    """``airflow api-server`` on this test session's SQLite metadata DB, with a user and a password."""
    migrate_airflow_db()
    home, port = tmp_path_factory.mktemp("api_server"), free_ports(1)[0]
    (home / "logs").mkdir()
    airflow_home = configure_airflow_env()
    env = component_env(
        home,
        db_url=os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"],
        dags_folder=airflow_home / "dags",
        plugins_folder=airflow_home / "plugins",
        port=port,
    )
    password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(json.dumps({USERNAME: password}) + "\n")
    server = AirflowServices(base_url=f"http://127.0.0.1:{port}", home=home, env=env, password=password)
    cli = [str(Path(sys.executable).with_name("airflow")), "api-server", "--host", "127.0.0.1", "--port", str(port)]
    with (home / "logs" / "api-server.out").open("wb") as out:
        server.procs["api-server"] = subprocess.Popen(
            [*cli, "--workers", "1"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                server.health()
                break
            except Exception:
                proc = server.procs["api-server"]
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"api-server did not start:\n{server.log_tail('api-server')}") from None
                time.sleep(1.0)
        yield server
    finally:
        server.stop()


def test_failed_task_tags_the_mlflow_run_and_notes_the_dag_run(tracking_uri: str, api_server: AirflowServices) -> None:
    migrate_airflow_db()
    os.environ["AIRFLOW_CONN_AIRFLOW_API"] = json.dumps(
        {"conn_type": "http", "host": api_server.base_url, "login": USERNAME, "password": api_server.password}
    )
    dags = configure_airflow_env() / "dags"
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
    # The same summary on the DAG run's page, read back through the REST API.
    status, body = api_server.request(
        "GET", f"/api/v2/dags/failing_pipeline/dagRuns/{dag_run.run_id}", token=api_server.token()
    )
    assert status == 200 and body["note"] == summary, body
