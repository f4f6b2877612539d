"""YAML pipeline specs → DAG arguments, and bad specs skipped without hiding the good ones."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_spec_maps_data_keys_and_connections() -> None:
    from rlhf_airflow.pipeline.specs import spec_to_kwargs

    spec = {
        "schedule": "@daily",
        "preset": "tiny-cpu",
        "warm_start": "champion",
        "overrides": ["rollout.n=4"],
        "data": {"url": "s3://d/raw.jsonl", "field_map": {"prompt": "q"}},
        "params": {"keep_last": 3},
        "connections": {"s3": None, "ray": "ray_gpu"},
        "tags": ["nightly"],
    }
    kwargs = spec_to_kwargs(spec, source=Path("specs/my-run.yaml"))
    assert kwargs["dag_id"] == "rlhf_my_run"
    assert kwargs["param_defaults"] == {
        "keep_last": 3,
        "dataset_url": "s3://d/raw.jsonl",
        "field_map": {"prompt": "q"},
        "preset": "tiny-cpu",
        "overrides": ["rollout.n=4"],
        "warm_start": "champion",
    }
    assert (kwargs["s3_conn_id"], kwargs["ray_conn_id"]) == (None, "ray_gpu")
    assert kwargs["tags"] == ["scheduled", "nightly"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"preset": "tiny-cpu"}, "'schedule' is missing"),
        ({"schedule": None, "scheduel": "@daily"}, r"unknown key\(s\) \['scheduel'\]"),
        ({"schedule": None, "data": {"uri": "x"}}, r"unknown data key\(s\) \['uri'\]"),
        ({"schedule": None, "overrides": "rollout.n=4"}, "overrides must be a list"),
        ("just text", "must be a mapping"),
    ],
)
def test_bad_spec_names_the_problem(spec: object, message: str) -> None:
    from rlhf_airflow.pipeline.specs import SpecError, spec_to_kwargs

    with pytest.raises(SpecError, match=message):
        spec_to_kwargs(spec, source=Path("specs/x.yaml"))


def test_a_bad_spec_is_skipped_with_a_warning(tmp_path: Path) -> None:
    from rlhf_airflow.pipeline.specs import load_spec_dags

    (tmp_path / "good.yaml").write_text("schedule: '@weekly'\npreset: tiny-cpu\n")
    (tmp_path / "bad.yaml").write_text("schedule: '@weekly'\nparams: {not_a_param: 1}\n")
    with pytest.warns(UserWarning, match=r"skipping pipeline spec bad.yaml: unknown pipeline parameter"):
        dags = load_spec_dags(tmp_path)
    assert list(dags) == ["rlhf_good"]


def test_spec_pool_and_max_active_runs_reach_the_dag() -> None:
    from rlhf_airflow.pipeline.factory import build_pipeline_dag
    from rlhf_airflow.pipeline.specs import spec_to_kwargs
    from rlhf_airflow.pools import ClusterPool

    spec = {
        "schedule": None,
        "max_active_runs": 3,
        "pool": {"name": "gpu_cluster", "slots": 16, "train_slots": 8, "eval_slots": 2},
    }
    kwargs = spec_to_kwargs(spec, source=Path("specs/gpu.yaml"))
    assert kwargs["pool"] == ClusterPool(name="gpu_cluster", slots=16, train_slots=8, eval_slots=2)
    dag = build_pipeline_dag(**kwargs)
    assert dag.max_active_runs == 3
    pooled = {t.task_id: (t.pool, t.pool_slots) for t in dag.tasks if t.pool != "default_pool"}
    assert pooled == {"train": ("gpu_cluster", 8), "evaluate.evaluate_checkpoint": ("gpu_cluster", 2)}


def test_spec_without_pool_gets_the_default_cluster_pool() -> None:
    from rlhf_airflow.pipeline.factory import build_pipeline_dag
    from rlhf_airflow.pipeline.specs import spec_to_kwargs

    dag = build_pipeline_dag(**spec_to_kwargs({"schedule": None}, source=Path("specs/plain.yaml")))
    assert dag.max_active_runs == 1
    assert (dag.get_task("train").pool, dag.get_task("train").pool_slots) == ("rlhf_cluster", 1)
    assert dag.get_task("evaluate.evaluate_checkpoint").pool == "rlhf_cluster"
    assert dag.get_task("register_model").pool == "default_pool"  # only the cluster's heavy tasks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"schedule": None, "max_active_runs": 0}, "max_active_runs must be a positive integer, got 0"),
        ({"schedule": None, "max_active_runs": "2"}, "max_active_runs must be a positive integer"),
        ({"schedule": None, "pool": {"size": 4}}, r"unknown pool key\(s\) \['size'\]"),
        ({"schedule": None, "pool": {"slots": 0}}, "pool.slots must be a positive integer"),
        ({"schedule": None, "pool": {"slots": 2, "train_slots": 4}}, "pool.train_slots=4 exceeds pool.slots=2"),
        ({"schedule": None, "pool": "rlhf_cluster"}, "pool must be a mapping"),
    ],
)
def test_bad_pool_or_max_active_runs_names_the_problem(spec: object, message: str) -> None:
    from rlhf_airflow.pipeline.specs import SpecError, spec_to_kwargs

    with pytest.raises(SpecError, match=message):
        spec_to_kwargs(spec, source=Path("specs/x.yaml"))


def test_approval_off_by_default_leaves_no_gate_and_register_moves_the_alias() -> None:
    from rlhf_airflow.pipeline.factory import build_pipeline_dag
    from rlhf_airflow.pipeline.specs import spec_to_kwargs

    dag = build_pipeline_dag(**spec_to_kwargs({"schedule": None}, source=Path("specs/plain.yaml")))
    assert "approve_champion" not in dag.task_ids
    assert dag.get_task("promote_champion").upstream_task_ids == {"register_model", "start_tracking"}
    assert dag.get_task("register_model").request["move"] is True


def test_approval_on_puts_the_gate_between_register_and_the_alias_move() -> None:
    from datetime import timedelta

    from airflow.providers.standard.operators.hitl import ApprovalOperator

    from rlhf_airflow.pipeline.factory import build_pipeline_dag
    from rlhf_airflow.pipeline.specs import spec_to_kwargs

    spec = {"schedule": None, "approval": {"enabled": True, "timeout_hours": 24, "assigned_users": ["alice"]}}
    dag = build_pipeline_dag(**spec_to_kwargs(spec, source=Path("specs/gated.yaml")))
    gate = dag.get_task("approve_champion")
    assert isinstance(gate, ApprovalOperator)
    assert gate.upstream_task_ids == {"register_model"}
    up = dag.get_task("promote_champion").upstream_task_ids
    assert up == {"approve_champion", "register_model", "start_tracking"}
    assert dag.get_task("register_model").request["move"] is False  # the alias waits for the approval
    assert (gate.options, gate.defaults) == (["Approve", "Reject"], ["Reject"])  # a timeout rejects
    assert gate.response_timeout == timedelta(hours=24)
    assert gate.assigned_users == [{"id": "alice", "name": "alice"}]
    assert gate.retries >= 2 and dag.get_task("end_tracking").is_teardown


@pytest.mark.parametrize(
    ("approval", "message"),
    [
        ({"enabled": "yes"}, "approval.enabled must be true or false"),
        ({"enabled": True, "timeout_hours": 0}, "approval.timeout_hours must be a positive number"),
        ({"enabled": True, "approvers": ["a"]}, r"unknown approval key\(s\) \['approvers'\]"),
        ({"enabled": True, "assigned_users": "alice"}, "approval.assigned_users must be a list"),
    ],
)
def test_bad_approval_names_the_problem(approval: object, message: str) -> None:
    from rlhf_airflow.pipeline.specs import SpecError, spec_to_kwargs

    with pytest.raises(SpecError, match=message):
        spec_to_kwargs({"schedule": None, "approval": approval}, source=Path("specs/x.yaml"))
