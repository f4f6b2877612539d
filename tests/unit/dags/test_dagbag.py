"""The DAGs folder parses cleanly, light, and every DAG follows the platform's Airflow rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.airflow_env import configure_airflow_env

ROOT = Path(__file__).resolve().parents[3]
DAGS = ROOT / "dags"
EXPECTED = {"rlhf_ppo", "rlhf_tiny_cpu_weekly", "rlhf_qwen2_5_0_5b_grpo_gpu_daily", "rlhf_champion_report"}


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import BundleDagBag

    return BundleDagBag(dag_folder=str(DAGS), bundle_path=str(DAGS), bundle_name="dags-folder")


def test_dagbag_has_no_import_errors_and_every_dag(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert set(dagbag.dags) == EXPECTED


def test_every_dag_has_tags_retries_and_a_static_start(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        assert "rlhf" in dag.tags, dag.dag_id
        assert dag.start_date is not None and dag.catchup is False, dag.dag_id
        for task in dag.tasks:
            assert task.retries >= 2, f"{dag.dag_id}.{task.task_id} has retries={task.retries}"


def test_pipeline_shape(dagbag: Any) -> None:
    dag = dagbag.dags["rlhf_ppo"]
    up = {t.task_id: set(t.upstream_task_ids) for t in dag.tasks}
    # fetch_champion (a Ray job, skipped unless warm_start is champion) runs beside prepare_data; preflight runs
    # after both, also when fetch_champion was skipped
    assert up["fetch_champion"] == set() and up["preflight"] == {"prepare_data", "fetch_champion"}
    assert dag.get_task("preflight").trigger_rule == "none_failed"
    assert up["start_tracking"] == {"preflight", "prepare_data"}
    assert "start_tracking" in up["train"]
    # evaluation waits on the plan and the MLflow run, not on train: it runs while training goes on
    assert "train" not in up["evaluate.wait_for_checkpoint"] | up["evaluate.evaluate_checkpoint"]
    assert {"train", "evaluate.evaluate_checkpoint"} <= up["sync_and_retain"]
    assert "sync_and_retain" in up["register_model"]
    assert dag.get_task("end_tracking").is_teardown
    assert dag.get_task("evaluate.wait_for_checkpoint").mode == "reschedule"
    assert dag.get_task("train").deferrable is True
    assert dag.max_active_runs == 4
    assert {t.task_id for t in dag.tasks if t.pool == "rlhf_cluster"} == {"train", "evaluate.evaluate_checkpoint"}


def test_assets_outlets_and_the_downstream_dag(dagbag: Any) -> None:
    dag = dagbag.dags["rlhf_ppo"]
    outlets = {t.task_id: [(a.name, a.uri) for a in t.outlets] for t in dag.tasks if t.outlets}
    assert outlets == {
        "prepare_data": [("rlhf_ppo.prepared_data", "x-rlhf://rlhf_ppo/prepared-data")],
        "evaluate.evaluate_checkpoint": [("rlhf_ppo.checkpoint", "x-rlhf://rlhf_ppo/checkpoint")],
        "register_model": [("rlhf_ppo.registered_model", "x-rlhf://rlhf_ppo/registered-model")],
        "promote_champion": [("rlhf_ppo.champion", "x-rlhf://rlhf_ppo/champion")],
    }
    up = {t.task_id: set(t.upstream_task_ids) for t in dag.tasks}
    assert up["promote_champion"] == {"register_model", "start_tracking"}
    downstream = dagbag.dags["rlhf_champion_report"]
    assert [a.name for a in downstream.timetable.asset_condition.objects] == ["rlhf_ppo.champion"]
    weekly = dagbag.dags["rlhf_tiny_cpu_weekly"]  # each generated pipeline has its own Assets
    assert {a.name for t in weekly.tasks for a in t.outlets} >= {"rlhf_tiny_cpu_weekly.champion"}


def test_scheduled_specs(dagbag: Any) -> None:
    weekly = dagbag.dags["rlhf_tiny_cpu_weekly"]
    assert weekly.params["warm_start"] == "champion"
    assert weekly.params["overrides"] == ["trainer.total_training_steps=20", "trainer.save_freq=10"]
    assert "scheduled" in weekly.tags
    gpu = dagbag.dags["rlhf_qwen2_5_0_5b_grpo_gpu_daily"]
    assert gpu.params["preset"] == "qwen2.5-0.5b-grpo-gpu"
    assert gpu.params["field_map"]["ground_truth"] == "answer|gsm8k_final_answer"
    # its heavy tasks are Ray jobs like training (no executor queue of their own)
    assert gpu.get_task("evaluate.evaluate_checkpoint").queue == gpu.get_task("train").queue
    # the spec's cluster pool: training holds a node's 8 GPUs, each evaluation one; one run at a time
    assert (gpu.get_task("train").pool, gpu.get_task("train").pool_slots) == ("gpu_cluster", 8)
    assert (gpu.get_task("evaluate.evaluate_checkpoint").pool_slots, gpu.max_active_runs) == (1, 1)


def test_parsing_imports_no_heavy_library() -> None:
    code = (
        "import sys\n"
        "from airflow.dag_processing.dagbag import BundleDagBag\n"
        f"bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r}, bundle_name='dags-folder')\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "assert len(bag.dags) == 4, sorted(bag.dags)\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers', 'mlflow', 'ray') if m in sys.modules)\n"
        "print('heavy=' + ','.join(heavy))\n"
    )
    env = {**os.environ, "AIRFLOW_HOME": str(configure_airflow_env()), "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "heavy="


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("preset", "gpt-5"),
        ("algorithm", "dpo"),
        ("total_training_steps", 0),
        ("learning_rate", -1e-5),
        ("rollout_n", 0),
        ("overrides", ["no equals sign"]),
        ("remote_store_url", "bucket/x"),  # no scheme (any installed fsspec protocol is a store)
        ("field_map", {"question": "prompt"}),
        ("kl_coef", "0.1"),
        ("warm_start", "yesterday"),
    ],
)
def test_params_schema_refuses_a_bad_value(name: str, value: Any) -> None:
    from airflow.sdk.definitions.param import ParamValidationError

    from rlhf_airflow.pipeline.params import pipeline_params

    with pytest.raises(ParamValidationError):
        pipeline_params()[name].resolve(value)


def test_params_schema_accepts_a_good_form() -> None:
    from rlhf_airflow.pipeline.params import pipeline_params
    from rlhf_ops.pipeline.params import parse_params

    values = {
        "preset": "tiny-cpu",
        "algorithm": "rloo",
        "total_training_steps": 8,
        "learning_rate": 1e-4,
        "field_map": {"prompt": "question"},
        "overrides": ["rollout.temperature=0.7"],
        "remote_store_url": "s3://bucket/ckpt",
        "ray_address": "http://ray-head:8265",
        "use_kl_loss": True,
    }
    params = pipeline_params()
    resolved = {name: param.resolve(values.get(name, param.value)) for name, param in params.items()}
    assert parse_params(resolved).learning_rate == 1e-4
