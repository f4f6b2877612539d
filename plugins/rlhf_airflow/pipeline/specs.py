"""Recurring pipelines declared as YAML files in ``dags/specs/``: one DAG per file.

A spec (every key but ``schedule`` is optional)::

    dag_id: rlhf_tiny_cpu_weekly        # default: rlhf_<file stem>
    description: Weekly copy-digit run
    schedule: "0 3 * * 1"               # cron, "@weekly"…, or null (triggered only)
    preset: tiny-cpu
    data:
      url: builtin:copy_digit           # dataset_url
      val_url: null                     # val_dataset_url
      field_map: {prompt: question}
    overrides: [trainer.total_training_steps=20]
    allowed_overrides: [model.lora.*]   # keys the trigger form's overrides may set besides the default set
    code: {py_modules: [s3://team-code/rewards.zip], pip: [], working_dir: null}   # shipped with every run
    allowed_code: {py_modules: ["s3://team-code/*"]}   # what the form's `code` may ship (nothing by default)
    warm_start: champion                # or scratch: start from the preset's model
    params: {keep_last: 1}              # defaults of any other form parameter
    tags: [weekly]
    connections: {ray: ray_default, mlflow: mlflow_default, s3: null, api: airflow_api}
    max_active_runs: 1                  # concurrent runs of this DAG
    pool: {name: rlhf_cluster, slots: 4, train_slots: 1, eval_slots: 1}   # rlhf_airflow.pools
    approval: {enabled: false, timeout_hours: 72, assigned_users: []}    # rlhf_airflow.pipeline.approval

Parsing reads YAML only. A spec with a mistake is skipped with a warning (shown by Airflow as a DAG
warning) and does not take the other specs down.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from airflow.sdk import DAG

from rlhf_airflow.compat import yaml
from rlhf_airflow.pipeline.approval import approval_spec
from rlhf_airflow.pipeline.factory import build_pipeline_dag
from rlhf_airflow.pools import cluster_pool

SPEC_KEYS = frozenset(
    {
        "dag_id",
        "description",
        "schedule",
        "preset",
        "data",
        "overrides",
        "allowed_overrides",
        "code",
        "allowed_code",
        "warm_start",
        "params",
        "tags",
        "connections",
        "max_active_runs",
        "pool",
        "approval",
    }
)
DATA_KEYS = {"url": "dataset_url", "val_url": "val_dataset_url", "field_map": "field_map"}
CONNECTION_KEYS = {"ray": "ray_conn_id", "mlflow": "mlflow_conn_id", "s3": "s3_conn_id", "api": "api_conn_id"}
_DAG_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SpecError(ValueError):
    """A spec file that cannot become a DAG; the message names the file and the key."""


def _mapping(value: Any, *, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def spec_to_kwargs(spec: Any, *, source: Path) -> dict[str, Any]:
    """``build_pipeline_dag`` keyword arguments of one parsed spec.

    Raises:
        SpecError: unknown keys, wrong types, or a missing ``schedule``.
    """
    spec = _mapping(spec, where=str(source))
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise SpecError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(SPEC_KEYS)}")
    if "schedule" not in spec:
        raise SpecError(f"{source}: 'schedule' is missing; set a cron string, a preset like '@weekly', or null")
    dag_id = str(spec.get("dag_id") or f"rlhf_{source.stem}").replace("-", "_")
    if not _DAG_ID.match(dag_id):
        raise SpecError(f"{source}: dag_id {dag_id!r} must be letters, digits, '_', '.' or '-'")
    params = dict(_mapping(spec.get("params"), where=f"{source}: params"))
    data = _mapping(spec.get("data"), where=f"{source}: data")
    for key, param in DATA_KEYS.items():
        if key in data:
            params[param] = data.pop(key)
    if data:
        raise SpecError(f"{source}: unknown data key(s) {sorted(data)}; valid: {sorted(DATA_KEYS)}")
    for key in ("preset", "overrides", "warm_start"):
        if key in spec:
            params[key] = spec[key]
    if not isinstance(params.get("overrides", []), list):
        raise SpecError(f"{source}: overrides must be a list of 'dotted.key=value' strings")
    allowed = spec.get("allowed_overrides") or []
    if not isinstance(allowed, list) or not all(isinstance(p, str) and p for p in allowed):
        raise SpecError(f"{source}: allowed_overrides must be a list of dotted-key patterns, e.g. [model.lora.*]")
    from rlhf_ops.pipeline.override_policy import OverridePolicy

    code = {"code": spec["code"]} if spec.get("code") else {}
    code |= {"allowed_code": spec["allowed_code"]} if spec.get("allowed_code") else {}
    try:
        OverridePolicy.from_dict(code)
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    conns = _mapping(spec.get("connections"), where=f"{source}: connections")
    if set(conns) - set(CONNECTION_KEYS):
        raise SpecError(f"{source}: unknown connection key(s) {sorted(set(conns) - set(CONNECTION_KEYS))}")
    max_runs = spec.get("max_active_runs", 1)
    if not isinstance(max_runs, int) or isinstance(max_runs, bool) or max_runs < 1:
        raise SpecError(f"{source}: max_active_runs must be a positive integer, got {max_runs!r}")
    try:
        pool = cluster_pool(_mapping(spec.get("pool"), where=f"{source}: pool"))
        approval = approval_spec(_mapping(spec.get("approval"), where=f"{source}: approval"))
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    return {
        "dag_id": dag_id,
        "max_active_runs": max_runs,
        "pool": pool,
        "approval": approval,
        "schedule": spec["schedule"],
        "param_defaults": params,
        "tags": ["scheduled", *[str(t) for t in spec.get("tags") or []]],
        "description": spec.get("description"),
        # Not a form parameter (the form's user must not widen it): passed to the preflight task by the DAG.
        "override_policy": {
            "extra_allowed": allowed,
            "trusted": params.get("overrides", []),
            "spec": str(source),
            **code,
        },
        **{CONNECTION_KEYS[k]: v for k, v in conns.items()},
    }


def load_spec_dags(spec_dir: Path) -> dict[str, DAG]:
    """``{dag_id: DAG}`` for every ``*.yaml`` / ``*.yml`` in ``spec_dir``; bad specs are warned about and skipped."""
    dags: dict[str, DAG] = {}
    for path in sorted([*spec_dir.glob("*.yaml"), *spec_dir.glob("*.yml")]):
        try:
            kwargs = spec_to_kwargs(yaml.safe_load(path.read_text()), source=path)
            if kwargs["dag_id"] in dags:
                raise SpecError(f"{path}: dag_id {kwargs['dag_id']!r} is already used by another spec")
            dags[kwargs["dag_id"]] = build_pipeline_dag(**kwargs)
        except Exception as exc:  # one bad spec must not hide the others
            warnings.warn(f"skipping pipeline spec {path.name}: {exc}", stacklevel=1)
    return dags
