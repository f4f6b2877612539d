"""The approval gate before the champion alias moves, answered through Airflow's HITL REST API.

A pipeline spec with ``approval: {enabled: true}`` is added to a copy of ``dags/`` and run twice on tiny-cpu
(2 steps, one checkpoint) through ``dag.test()`` against a private Ray head (token auth) and an MLflow server,
the local folder as the checkpoints' store. While a run waits in ``approve_champion`` (the ``awaiting_input``
state of Airflow 3.3), a responder answers it with ``PATCH .../hitlDetails`` on Airflow's REST API (the core API
app, in this process, on the same metadata DB: the way Airflow documents answering a ``dag.test()`` run).

1. Rejected: the run succeeds, ``promote_champion`` is skipped, no version holds the ``champion`` alias.
2. Approved (still no champion to beat): ``promote_champion`` moves the alias to the second run's version.

About 4-6 minutes on 2 shared cores (two short training runs).
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env, migrate_airflow_db

configure_airflow_env()  # before anything imports airflow

import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from rlhf_ops.pipeline.local_stack import start_ray_head  # noqa: E402
from tests.support.mlflow_server import mlflow_server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "rlhf_gated_e2e"
REGISTERED = f"{DAG_ID}-tiny-cpu"
SPEC = f"""\
dag_id: {DAG_ID}
schedule: null
preset: tiny-cpu
connections: {{s3: null}}
approval: {{enabled: true, timeout_hours: 1}}
"""
CONF: dict[str, Any] = {
    "total_training_steps": 2,
    "rollout_n": 4,
    "learning_rate": 0.002,
    "eval_max_prompts": 16,
    "eval_n_samples": 2,
    "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false"],
}


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """MLflow and a Ray head; the Airflow connections ``mlflow_default``, ``ray_default``, ``aws_default``."""
    saved = dict(os.environ)
    # The job entrypoint runs `python -m …`: the Ray head must find this virtualenv's interpreter first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    # The REST API's token without a password (simple auth manager): the responder stands for a signed-in admin.
    os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
    token = secrets.token_hex(16)
    with mlflow_server(root=tmp_path_factory.mktemp("mlflow")) as tracking_uri:
        head = start_ray_head(tmp_path_factory.mktemp("ray"), auth_token=token, num_cpus=2)
        port = int(head.url.rsplit(":", 1)[1])
        os.environ.update(
            {
                "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
                    {"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token}
                ),
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": tracking_uri}),
                "AIRFLOW_CONN_AWS_DEFAULT": json.dumps({"conn_type": "aws"}),  # the local-folder store needs no keys
            }
        )
        try:
            yield {"tracking_uri": tracking_uri, "dashboard": head.url}
        finally:
            head.stop()
            os.environ.clear()
            os.environ.update(saved)


class Responder(threading.Thread):
    """Answers the first pending ``approve_champion`` request of ``DAG_ID`` through the REST API."""

    def __init__(self, client: Any, option: str, timeout_s: float = 900.0) -> None:
        super().__init__(daemon=True)
        self.client, self.option, self.timeout_s = client, option, timeout_s
        self.seen: dict[str, Any] | None = None
        self.answer: tuple[int, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            token = self.client.get("/auth/token").json()["access_token"]
            headers = {"Authorization": f"Bearer {token}"}
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and self.answer is None:
                resp = self.client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/~/hitlDetails", headers=headers)
                assert resp.status_code == 200, resp.text
                for detail in resp.json()["hitl_details"]:
                    ti = detail["task_instance"]
                    if ti["task_id"] != "approve_champion" or detail["response_received"]:
                        continue
                    self.seen = detail
                    run = ti["dag_run_id"]
                    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{run}/taskInstances/approve_champion/-1/hitlDetails"
                    body = {"chosen_options": [self.option], "params_input": {}}
                    patched = self.client.patch(path, json=body, headers=headers)
                    self.answer = (patched.status_code, patched.json())
                    break
                time.sleep(2.0)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc


@pytest.fixture(scope="module")
def gated_runs(services: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the gated DAG twice: rejected, then approved; returns both DAG runs and what the responder saw."""
    migrate_airflow_db()
    dags = configure_airflow_env() / "dags"
    shutil.copytree(ROOT / "dags", dags, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    (dags / "specs" / "gated_e2e.yaml").write_text(SPEC)
    from airflow.api_fastapi.app import create_app
    from airflow.dag_processing.dagbag import BundleDagBag
    from fastapi.testclient import TestClient

    bag = BundleDagBag(dag_folder=str(dags), bundle_path=str(dags), bundle_name="dags-folder")
    assert not bag.import_errors and DAG_ID in bag.dags, bag.import_errors
    client = TestClient(create_app(apps="core"))
    runs: dict[str, Any] = {}
    for option in ("Reject", "Approve"):
        conf = {
            **CONF,
            "work_dir": str(tmp_path_factory.mktemp("work")),
            "remote_store_url": tmp_path_factory.mktemp("remote").as_uri(),
            "ray_address": services["dashboard"],
        }
        responder = Responder(client, option)
        responder.start()
        dag_run = bag.dags[DAG_ID].test(run_conf=conf)
        responder.join(timeout=60)
        assert responder.error is None, repr(responder.error)
        runs[option] = {
            "dag_run": dag_run,
            "seen": responder.seen,
            "answer": responder.answer,
            "aliases": _aliases(services["tracking_uri"]),  # right after this run, before the next one
        }
    return runs


def _aliases(tracking_uri: str) -> dict[str, list[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    versions = client.search_model_versions(f"name='{REGISTERED}'")  # its results carry no aliases: get each
    return {v.version: sorted(client.get_model_version(REGISTERED, v.version).aliases) for v in versions}


def _states(run_id: str) -> dict[str, str]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.query(TaskInstance).filter(TaskInstance.run_id == run_id).all()
        return {ti.task_id: str(ti.state) for ti in rows if ti.map_index < 0}


def _mlflow_run_id(run_id: str) -> str:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(run_id=run_id, dag_ids=DAG_ID, task_ids="start_tracking", key="mlflow_run_id")
        value = session.execute(query.with_only_columns(XComModel.value)).scalar_one()
    for _ in range(2):  # stored as JSON, and values pushed by tasks are JSON-encoded once more
        if isinstance(value, str) and value.startswith('"'):
            value = json.loads(value)
    return str(value)


def test_the_request_names_the_version_and_offers_approve_or_reject(gated_runs: dict[str, Any]) -> None:
    for option, version in (("Reject", "1"), ("Approve", "2")):
        seen, (status, answer) = gated_runs[option]["seen"], gated_runs[option]["answer"]
        assert seen is not None, f"no approval request seen in the {option} run"
        assert seen["options"] == ["Approve", "Reject"] and seen["defaults"] == ["Reject"]
        assert seen["subject"] == f"Move the champion of {REGISTERED} to v{version}?"
        assert f"registered **{REGISTERED} v{version}**\n(step 2)" in seen["body"]
        assert "current champion\n(none yet)" in seen["body"]  # the rejected run left none to beat
        assert "Approve to move the `champion` alias" in seen["body"]
        assert status == 200 and answer["chosen_options"] == [option], answer


def test_a_rejection_keeps_the_alias_where_it_was(gated_runs: dict[str, Any], services: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    dag_run = gated_runs["Reject"]["dag_run"]
    states = _states(dag_run.run_id)
    assert dag_run.state == "success", states
    assert (states["register_model"], states["approve_champion"]) == ("success", "success")
    assert states["promote_champion"] == "skipped" and states["end_tracking"] == "success"
    assert gated_runs["Reject"]["aliases"] == {"1": []}  # registered, but not the champion
    tags = MlflowClient(services["tracking_uri"]).get_run(_mlflow_run_id(dag_run.run_id)).data.tags
    assert "rlhf.promoted" not in tags  # the alias move never ran


def test_an_approval_moves_the_alias(gated_runs: dict[str, Any], services: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    dag_run = gated_runs["Approve"]["dag_run"]
    states = _states(dag_run.run_id)
    assert dag_run.state == "success", states
    assert {states[t] for t in ("register_model", "approve_champion", "promote_champion")} == {"success"}
    assert gated_runs["Approve"]["aliases"] == {"1": [], "2": ["champion"]}
    champion = MlflowClient(services["tracking_uri"]).get_model_version_by_alias(REGISTERED, "champion")
    assert champion.version == "2" and champion.run_id == _mlflow_run_id(dag_run.run_id)
