"""Secrets through the whole pipeline: the e2e harness (``tests/e2e/test_pipeline_dag.py``: ``dag.test()``, a
private Ray head with token auth, an MLflow server, moto S3) with realistic AWS keys, a Ray token and an MLflow
password in the Airflow workers' environment and connections (the Ray cluster has its own identity: nothing is
forwarded); then every byte the run left is scanned, and what the Ray Jobs API serves (``list_jobs``,
``get_job_info``, the dashboard's ``GET /api/jobs/``, every job's log): the MLflow
server's folder (params, tags, artifacts), the Airflow home (its database: XCom, rendered task fields; task
logs), the Ray head's temp folder (job driver logs), the work folder (checkpoints) and every S3 object.
HEAVY (a real pipeline run, ~4 minutes on a quiet machine): run it under the heavy lock.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()  # before anything imports airflow

import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402
from ray.job_submission import JobSubmissionClient  # noqa: E402

from rlhf_ops.pipeline.local_stack import start_ray_head  # noqa: E402
from tests.e2e.test_pipeline_dag import BUCKET, pipeline_run  # noqa: E402,F401  (the harness's run fixture)
from tests.reliability.conftest import Figures  # noqa: E402
from tests.reliability.test_secrets import (  # noqa: E402
    AWS_KEY_ID,
    AWS_SECRET,
    MLFLOW_PASSWORD,
    RAY_TOKEN,
    scan,
)
from tests.support.mlflow_server import mlflow_server  # noqa: E402
from tests.support.moto_server import REGION, running_moto_server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The e2e services, with the secrets where a deployment keeps them (the harness's own uses test values)."""
    saved = dict(os.environ)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.update(
        {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    )
    mlflow_root = tmp_path_factory.mktemp("mlflow")
    before = set(glob.glob("/tmp/rayt_*"))
    with running_moto_server() as moto, mlflow_server(root=mlflow_root) as tracking_uri:
        moto.create_bucket(BUCKET)
        # The cluster's own identity (the nodes' role / a mounted secret): the connections' secrets never reach it.
        cluster = {
            "AWS_ACCESS_KEY_ID": "cluster-key",
            "AWS_SECRET_ACCESS_KEY": "cluster-secret",
            "RLHF_WORK_DIR": str(tmp_path_factory.mktemp("ray_work")),
        }
        os.environ.update(cluster)
        try:
            head = start_ray_head(tmp_path_factory.mktemp("ray"), auth_token=RAY_TOKEN, num_cpus=2)
        finally:
            for name in cluster:
                os.environ.pop(name)
        # The Airflow workers' environment holds the deployment's secrets too.
        os.environ.update(
            {
                "RLHF_WORK_DIR": str(tmp_path_factory.mktemp("airflow_work")),
                "AWS_ACCESS_KEY_ID": AWS_KEY_ID,
                "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
                "MLFLOW_TRACKING_USERNAME": "mlflow-admin",
                "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
            }
        )
        port = int(head.url.rsplit(":", 1)[1])
        os.environ.update(
            {
                "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
                    {"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": RAY_TOKEN}
                ),
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps(
                    {"conn_type": "http", "host": tracking_uri, "login": "mlflow-admin", "password": MLFLOW_PASSWORD}
                ),
                "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                    {
                        "conn_type": "aws",
                        "login": AWS_KEY_ID,
                        "password": AWS_SECRET,
                        # Opt-in forwarding: the jobs get STS session credentials, never these long-lived keys.
                        "extra": {
                            "endpoint_url": moto.endpoint_url,
                            "region_name": REGION,
                            "forward_credentials": True,
                        },
                    }
                ),
            }
        )
        ray_dirs = sorted(set(glob.glob("/tmp/rayt_*")) - before)
        try:
            yield {
                "tracking_uri": tracking_uri,
                "dashboard": head.url,
                "s3": moto.client(),
                "mlflow_root": mlflow_root,
                "ray_dirs": ray_dirs,
            }
        finally:
            head.stop()
            os.environ.clear()
            os.environ.update(saved)


def test_a_pipeline_run_leaves_no_secret_anywhere(
    pipeline_run: dict[str, Any],  # noqa: F811
    services: dict[str, Any],
    tmp_path: Path,
    figures: Figures,
) -> None:
    assert pipeline_run["dag_run"].state == "success"
    s3 = services["s3"]
    objects = tmp_path / "s3"
    for obj in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        path = objects / obj["Key"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
    places = {
        "mlflow": services["mlflow_root"],
        "airflow_home": configure_airflow_env(),
        "s3_objects": objects,
        **{f"ray_{i}": Path(d) for i, d in enumerate(services["ray_dirs"])},
    }
    work = pipeline_run["xcom"]("preflight", "layout") or {}
    if isinstance(work, dict) and work.get("checkpoint_root"):
        places["checkpoints"] = Path(str(work["checkpoint_root"]))
    # What anyone who can read the Ray dashboard sees: the Jobs API (SDK and REST) and every job's log.
    jobs_api = tmp_path / "jobs_api"
    jobs_api.mkdir()
    headers = {"Authorization": f"Bearer {RAY_TOKEN}"}
    client = JobSubmissionClient(services["dashboard"], headers=headers)
    listed = client.list_jobs()
    assert len(listed) >= 7  # every heavy job and train
    (jobs_api / "list_jobs.json").write_text(json.dumps([j.model_dump(mode="json") for j in listed], default=str))
    rest = requests.get(f"{services['dashboard']}/api/jobs/", headers=headers, timeout=30)
    (jobs_api / "api_jobs.json").write_text(rest.text)
    for job in listed:
        sid = str(job.submission_id)
        info = client.get_job_info(sid).model_dump(mode="json")
        (jobs_api / f"{sid}.info.json").write_text(json.dumps(info, default=str))
        (jobs_api / f"{sid}.log").write_text(client.get_job_logs(sid))
    places["jobs_api"] = jobs_api
    found = {where: hits for where, root in places.items() if root.exists() and (hits := scan(root))}
    files = sum(1 for root in places.values() if root.exists() for p in root.rglob("*") if p.is_file())
    figures.record(places=len(places), files_scanned=files, occurrences=sum(len(v) for v in found.values()))
    assert found == {}
