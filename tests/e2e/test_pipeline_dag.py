"""The whole ``rlhf_ppo`` pipeline on tiny-cpu through ``dag.test()`` against real services.

A private Ray head (dashboard + job server, token auth as Ray 2.60 starts it), an MLflow server (SQLite +
proxied artifacts) and a moto S3 server as the remote checkpoint store, all on 127.0.0.1. The DAG files are
copied into the test's Airflow DAGs folder (``dag.test()`` in Airflow 3.3 needs the DAG in a bundle). Training
is a real Ray job (4 steps, a checkpoint every 2); each checkpoint is evaluated by its own mapped task.
About 3-4 minutes on 2 shared cores.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env, migrate_airflow_db

configure_airflow_env()  # before anything imports airflow

import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from rlhf_ops.pipeline.local_stack import start_ray_head  # noqa: E402
from tests.support.mlflow_server import mlflow_server  # noqa: E402
from tests.support.moto_server import REGION, running_moto_server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "rlhf-e2e"
STEPS, SAVE_FREQ = 4, 2


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Moto S3, MLflow and a Ray head; Airflow connections ``aws_default``, ``mlflow_default``, ``ray_default``."""
    saved = dict(os.environ)
    # The job entrypoint runs `python -m …`: the Ray head must find this virtualenv's interpreter first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.update(
        {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    )
    token = secrets.token_hex(16)
    with running_moto_server() as moto, mlflow_server(root=tmp_path_factory.mktemp("mlflow")) as tracking_uri:
        moto.create_bucket(BUCKET)
        # The cluster's own identity and work folder (nothing is forwarded from the connections): what the nodes'
        # role or a mounted secret gives a real cluster. The Airflow side gets a work folder of its own, unused.
        cluster = {
            "AWS_ACCESS_KEY_ID": "cluster-key",
            "AWS_SECRET_ACCESS_KEY": "cluster-secret",
            "RLHF_WORK_DIR": str(tmp_path_factory.mktemp("ray_work")),
        }
        os.environ.update(cluster)
        try:
            head = start_ray_head(tmp_path_factory.mktemp("ray"), auth_token=token, num_cpus=2)
        finally:
            for name in cluster:
                os.environ.pop(name)
        os.environ["RLHF_WORK_DIR"] = str(tmp_path_factory.mktemp("airflow_work"))
        port = int(head.url.rsplit(":", 1)[1])
        os.environ.update(
            {
                "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
                    {"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token}
                ),
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": tracking_uri}),
                "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                    {
                        "conn_type": "aws",
                        "login": "testing",
                        "password": "testing",
                        # Opt-in forwarding: the jobs get short-lived STS credentials (moto's), never these keys.
                        "extra": {
                            "endpoint_url": moto.endpoint_url,
                            "region_name": REGION,
                            "forward_credentials": True,
                        },
                    }
                ),
            }
        )
        try:
            yield {"tracking_uri": tracking_uri, "dashboard": head.url, "s3": moto.client(), "ray_token": token}
        finally:
            head.stop()
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(scope="module")
def pipeline_run(services: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the DAG once; returns the DAG run and its XComs."""
    migrate_airflow_db()
    dags = configure_airflow_env() / "dags"
    shutil.copytree(ROOT / "dags", dags, dirs_exist_ok=True)
    from airflow.dag_processing.dagbag import BundleDagBag

    bag = BundleDagBag(dag_folder=str(dags), bundle_path=str(dags), bundle_name="dags-folder")
    assert not bag.import_errors
    conf = {
        "preset": "tiny-cpu",
        "remote_store_url": f"s3://{BUCKET}/runs",
        "ray_address": services["dashboard"],
        "total_training_steps": STEPS,
        "save_freq": SAVE_FREQ,
        "learning_rate": 2e-3,
        "kl_coef": 0.002,
        "keep_last": 1,
        "eval_n_samples": 2,
        "eval_max_prompts": 32,
        "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false"],
    }
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import sync_bag_to_db

    # The downstream DAG scheduled on rlhf_ppo.champion must be known; its bundle row first (a foreign key).
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(bag, "dags-folder", None)
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import update

    with create_session() as session:  # new DAGs start paused, and a paused DAG is not queued by its Assets
        session.execute(update(DagModel).where(DagModel.dag_id == "rlhf_champion_report").values(is_paused=False))
    from rlhf_airflow.pools import ensure_pools, pools_of

    ensure_pools(pools_of(bag.dags.values()))  # as a deployer would (dag.test() itself ignores pools)
    heavy_before = _heavy_modules()
    dag_run = bag.dags["rlhf_ppo"].test(run_conf=conf)  # every Airflow-side task runs in this process
    return {
        "dag_run": dag_run,
        "xcom": lambda task, key="return_value": _xcom(dag_run.run_id, task, key),
        "heavy_modules": (heavy_before, _heavy_modules()),
    }


def _heavy_modules() -> list[str]:
    return sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)


def _xcom(run_id: str, task_id: str, key: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(run_id=run_id, dag_ids="rlhf_ppo", task_ids=task_id, key=key)
        row = session.execute(query.with_only_columns(XComModel.value)).first()
    value = None if row is None else row[0]
    for _ in range(2):  # stored as JSON, and task return values are JSON-encoded once more
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                break
    return value


def _task_states(run_id: str) -> dict[str, str]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.query(TaskInstance).filter(TaskInstance.run_id == run_id).all()
        return {f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in rows}


def test_pipeline_succeeds_every_task(pipeline_run: dict[str, Any]) -> None:
    dag_run = pipeline_run["dag_run"]
    states = _task_states(dag_run.run_id)
    assert dag_run.state == "success", states
    assert states.pop("fetch_champion[-1]") == "skipped", states  # warm_start: scratch (no job submitted)
    assert set(states.values()) == {"success"}, states
    # one evaluation per planned checkpoint: steps 2 and 4
    assert pipeline_run["xcom"]("plan_evaluations") == [2, 4]
    assert {k for k in states if k.startswith("evaluate.evaluate_checkpoint")} == {
        "evaluate.evaluate_checkpoint[0]",
        "evaluate.evaluate_checkpoint[1]",
    }


def test_heavy_tasks_ran_as_ray_jobs_and_the_airflow_side_imported_no_torch(
    pipeline_run: dict[str, Any], services: dict[str, Any]
) -> None:
    from ray.job_submission import JobSubmissionClient

    from rlhf_airflow.operators import derive_submission_id

    client = JobSubmissionClient(services["dashboard"], headers={"Authorization": f"Bearer {services['ray_token']}"})
    run_id = pipeline_run["dag_run"].run_id
    jobs = {j.submission_id: j for j in client.list_jobs() if (j.metadata or {}).get("airflow_run_id") == run_id}
    heavy = {
        ("prepare_data", -1): "prepare_data",
        ("preflight", -1): "preflight",
        ("evaluate.evaluate_checkpoint", 0): "evaluate",
        ("evaluate.evaluate_checkpoint", 1): "evaluate",
        ("sync_and_retain", -1): "retain",
        ("register_model", -1): "register",
    }
    layout = pipeline_run["xcom"]("preflight", "layout")
    results = {o["Key"] for o in _list(services["s3"], f"{_prefix(layout)}/jobs")}
    for (task_id, index), job in heavy.items():
        sid = derive_submission_id(dag_id="rlhf_ppo", run_id=run_id, task_id=task_id, map_index=index)
        assert jobs[sid].status == "SUCCEEDED" and f"pipeline-job {job}" in jobs[sid].entrypoint, sid
        assert f"{_prefix(layout)}/jobs/{sid}.json" in results  # the result came back through the remote store
    assert len(jobs) == len(heavy) + 1  # and train; no retries
    # The jobs worked in the cluster's folder; the Airflow side's own stayed empty (they share no disk).
    assert not layout["work_dir"].startswith(os.environ["RLHF_WORK_DIR"])
    assert not any(Path(os.environ["RLHF_WORK_DIR"]).iterdir())
    before, after = pipeline_run["heavy_modules"]
    if before:
        pytest.skip(f"an earlier test of this session imported {before}; run this module on its own")
    # dag.test() ran every Airflow-side task (the heavy tasks' submissions and result reads included) here.
    assert after == [], f"the Airflow-side tasks imported {after}"


def test_train_and_evaluations_ran_in_the_cluster_pool(pipeline_run: dict[str, Any]) -> None:
    from airflow.models.pool import Pool
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.query(TaskInstance).filter(TaskInstance.run_id == pipeline_run["dag_run"].run_id).all()
        pooled = sorted((ti.task_id, ti.map_index, ti.pool, ti.pool_slots) for ti in rows if ti.pool != "default_pool")
    assert pooled == [
        ("evaluate.evaluate_checkpoint", 0, "rlhf_cluster", 1),
        ("evaluate.evaluate_checkpoint", 1, "rlhf_cluster", 1),
        ("train", -1, "rlhf_cluster", 1),
    ]
    pool = Pool.get_pool("rlhf_cluster")
    assert pool is not None and pool.include_deferred  # the deferred train task keeps holding its slot


def test_mlflow_run_params_tags_and_metric_history(pipeline_run: dict[str, Any], services: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    from rlhf_airflow.operators import derive_submission_id
    from rlhf_ops.pipeline.layout import run_key

    run_id = pipeline_run["xcom"]("start_tracking", "mlflow_run_id")
    client = MlflowClient(services["tracking_uri"])
    run = client.get_run(run_id)
    dag_run_id = pipeline_run["dag_run"].run_id
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["actor.optim.lr"] == "0.002" and params["algorithm.kl_loss_coef"] == "0.002"
    assert params["trainer.total_training_steps"] == str(STEPS)
    assert params["trainer.run_name"] == run_key(dag_run_id)
    assert params["trainer.remote_store_url"] == f"s3://{BUCKET}/runs"
    tags = run.data.tags
    assert tags["airflow.dag_id"] == "rlhf_ppo" and tags["airflow.run_id"] == dag_run_id
    assert tags["ray.submission_id"] == derive_submission_id(dag_id="rlhf_ppo", run_id=dag_run_id, task_id="train")
    assert tags["rlhf.git_commit"]
    assert run.info.run_name.startswith("tiny-cpu/grpo/")
    # training metrics at every step, from the Ray job attached by MLFLOW_RUN_ID
    for key in ("actor/pg_loss", "critic/score/mean"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2, 3, 4], key


def test_eval_metrics_at_checkpoint_steps_match_eval_reports(
    pipeline_run: dict[str, Any], services: dict[str, Any], tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    run_id = pipeline_run["xcom"]("start_tracking", "mlflow_run_id")
    client = MlflowClient(services["tracking_uri"])
    layout = pipeline_run["xcom"]("preflight", "layout")
    history = {m.step: m.value for m in client.get_metric_history(run_id, "eval/reward/mean")}
    assert sorted(history) == [2, 4]  # logged at the checkpoints' global steps
    best = pipeline_run["xcom"]("sync_and_retain")["best_step"]
    for step in (2, 4):
        local = client.download_artifacts(run_id, f"eval/report_step_{step:06d}.json", str(tmp_path))
        report = json.loads(Path(local).read_text())
        if step in (4, best):  # kept by retention: eval.json beside the checkpoint on S3 too
            on_s3 = json.loads(_read_s3(services["s3"], f"{_prefix(layout)}/global_step_{step}/eval.json"))
            assert on_s3["metrics"] == report["metrics"] and on_s3["step"] == step
        assert report["step"] == step and report["settings"]["n_samples"] == 2
        assert report["metrics"]["eval/num_prompts"] == 32.0
        assert 0.0 <= report["metrics"]["eval/pass_at_2"] <= 1.0
        assert history[step] == pytest.approx(report["metrics"]["eval/reward/mean"])
    artifacts = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert artifacts == {"eval/report_step_000002.json", "eval/report_step_000004.json"}
    generations = {a.path for a in client.list_artifacts(run_id, "generations")}
    assert generations == {"generations/step_000002.json", "generations/step_000004.json"}
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"config", "data", "model"} <= top
    assert {a.path for a in client.list_artifacts(run_id, "data")} == {
        "data/manifest.json",
        "data/rejected_sample.jsonl",
    }


def test_registered_model_version_and_champion_alias(pipeline_run: dict[str, Any], services: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(services["tracking_uri"])
    registered = pipeline_run["xcom"]("register_model")
    run_id = pipeline_run["xcom"]("start_tracking", "mlflow_run_id")
    assert registered["registered_name"] == "rlhf_ppo-tiny-cpu"
    assert (registered["version"], registered["promoted"]) == ("1", True)
    champion = client.get_model_version_by_alias("rlhf_ppo-tiny-cpu", "champion")
    assert champion.version == "1" and champion.run_id == run_id
    assert champion.source == f"runs:/{run_id}/model"
    assert champion.tags["rlhf.eval_metric_name"] == "eval/reward/mean"
    assert float(champion.tags["rlhf.eval_metric_value"]) == pytest.approx(registered["value"])
    # An MLflow Model (transformers flavour) whose model/ folder is the HF export itself.
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(run_id, "model")}
    hf_files = {a.path for a in client.list_artifacts(run_id, "model/model")}
    assert {"model/model/config.json", "model/model/model.safetensors", "model/model/tokenizer.json"} <= hf_files


def test_asset_events_and_the_downstream_trigger(pipeline_run: dict[str, Any]) -> None:
    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    run_id = pipeline_run["dag_run"].run_id
    with create_session() as session:
        query = select(AssetModel.name, AssetEvent.extra).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
        events = session.execute(query.where(AssetEvent.source_run_id == run_id)).all()
        queued = session.scalars(select(AssetDagRunQueue.target_dag_id)).all()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, extra in events:
        by_name.setdefault(name, []).append(dict(extra or {}))
    prepared = pipeline_run["xcom"]("prepare_data")
    assert by_name["rlhf_ppo.prepared_data"] == [
        {
            k: prepared[k]
            for k in ("run_url", "train_url", "val_url", "num_train", "num_val", "num_rejected", "manifest_url")
        }
        | {"airflow_run_id": pipeline_run["xcom"]("preflight", "layout")["run_key"]}
    ]
    steps = sorted(e["step"] for e in by_name["rlhf_ppo.checkpoint"])
    assert steps == [2, 4] and all("eval/reward/mean" in e["metrics"] for e in by_name["rlhf_ppo.checkpoint"])
    registered = pipeline_run["xcom"]("register_model")
    (model,) = by_name["rlhf_ppo.registered_model"]
    assert (model["version"], model["model_uri"]) == (registered["version"], registered["model_uri"])
    # The first run has no champion to beat: the alias moves, the champion Asset gets its event, and the
    # downstream DAG scheduled on it is queued for the scheduler.
    (champion,) = by_name["rlhf_ppo.champion"]
    assert champion["version"] == "1" and champion["registered_name"] == "rlhf_ppo-tiny-cpu"
    assert "rlhf_champion_report" in queued


def test_checkpoints_in_s3_after_retention(pipeline_run: dict[str, Any], services: dict[str, Any]) -> None:
    layout = pipeline_run["xcom"]("preflight", "layout")
    retained = pipeline_run["xcom"]("sync_and_retain")
    s3, prefix = services["s3"], _prefix(layout)
    keys = {o["Key"].removeprefix(prefix + "/") for o in _list(s3, prefix)}
    best = retained["best_step"]
    assert best == pipeline_run["xcom"]("register_model")["best_step"]
    # keep_last=1 keeps the newest (4) plus the best; step 2 survives only as the best
    kept = {4} | {best}
    for step in (2, 4):
        assert (f"global_step_{step}/MANIFEST.json" in keys) == (step in kept), sorted(keys)
    assert "global_step_4/actor/.metadata" in keys and "global_step_4/eval.json" in keys
    assert _read_s3(s3, f"{prefix}/latest") == "global_step_4"
    assert retained["deleted_remote"] == ([] if best == 2 else [2])
    assert pipeline_run["xcom"]("train", "checkpoint_url") == f"s3://{BUCKET}/runs/rlhf_ppo/{layout['run_key']}"


def _prefix(layout: dict[str, Any]) -> str:
    return f"runs/rlhf_ppo/{layout['run_key']}"


def _list(s3: Any, prefix: str) -> list[dict[str, Any]]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return [obj for page in pages for obj in page.get("Contents", [])]


def _read_s3(s3: Any, key: str) -> str:
    return str(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode())
