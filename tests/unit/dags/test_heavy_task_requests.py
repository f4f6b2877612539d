"""The heavy tasks' Airflow side (request, result handling) is torch-free, and their requests are what the jobs read.

The jobs themselves run in ``tests/integration/test_ray_job_operator.py`` (re-attach, user mistakes) and the whole
pipeline in ``tests/e2e/test_pipeline_dag.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.airflow_env import configure_airflow_env

ROOT = Path(__file__).resolve().parents[3]

_CODE = """
import json, sys, types
from airflow.sdk.exceptions import AirflowSkipException
from rlhf_airflow.pipeline.factory import build_pipeline_dag
from rlhf_airflow.task_jobs import RayTaskJobOperator
from rlhf_ops.pipeline.job_requests import PIPELINE_JOBS, parse_request

dag = build_pipeline_dag("d", override_policy={"code": {"py_modules": ["/opt/team/rewards"]}})
heavy = {t.task_id: t for t in dag.tasks if isinstance(t, RayTaskJobOperator)}
assert sorted(heavy) == [
    "evaluate.evaluate_checkpoint", "fetch_champion", "preflight", "prepare_data", "register_model", "sync_and_retain"
]
assert {t.job for t in heavy.values()} == set(PIPELINE_JOBS.builtin_names())  # each built-in job has its task
assert all(t.code_policy == {"code": {"py_modules": ["/opt/team/rewards"]}} for t in heavy.values())
assert dag.get_task("train").code_policy == heavy["prepare_data"].code_policy
params = {k: dag.params[k] for k in dag.params}
params["work_dir"] = WORK
ctx = {"dag": dag, "run_id": "manual__1", "params": params}
prep = heavy["prepare_data"].request_for({"override_policy": {"extra_allowed": ["model.lora.*"]}}, ctx)
assert prep.request.run.work_dir == WORK and prep.request.override_policy["extra_allowed"] == ["model.lora.*"]
assert prep.request.params["preset"] == "tiny-cpu" and prep.num_gpus is None
assert prep.request.schema_version == 1
config = {"resources": {"device": "cuda"}, "rollout": {"engine": "vllm"}}
found = {"step": 2, "location": "s3://b/run/global_step_2"}
ev_request = {"found": found, "config": config, "mlflow_run_id": "abc"}
ev = heavy["evaluate.evaluate_checkpoint"].request_for(ev_request, ctx)
assert (ev.request.step, ev.request.engine, ev.num_gpus) == (2, "auto", 1.0)
reg = heavy["register_model"].request_for(
    {"config": config, "mlflow_run_id": "abc", "registered_name": "m", "move": False}, ctx
)
assert reg.request.move is False and reg.request.metric == "eval/reward/mean"
ret = heavy["sync_and_retain"].request_for({}, ctx)
assert ret.request.keep_last == 2
pre = heavy["preflight"].request_for({"prepared": {"num_train": 4}, "champion": None}, ctx)
assert pre.request.model_path is None and pre.request.prepared == {"num_train": 4}
try:  # warm_start scratch (the default): skipped before anything is submitted
    heavy["fetch_champion"].request_for({}, ctx)
    raise AssertionError("fetch_champion was not skipped")
except AirflowSkipException as exc:
    assert "warm_start is 'scratch'" in str(exc)
champ_ctx = {**ctx, "params": {**params, "warm_start": "champion"}}
fetch = heavy["fetch_champion"].request_for({}, champ_ctx)
assert fetch.request.registered_name == "d-tiny-cpu" and fetch.num_gpus is None
for op, spec in ((heavy["prepare_data"], prep), (heavy["evaluate.evaluate_checkpoint"], ev),
                 (heavy["register_model"], reg), (heavy["fetch_champion"], fetch), (heavy["preflight"], pre),
                 (heavy["sync_and_retain"], ret)):
    sent = spec.request.model_dump_json()  # what goes into $RLHF_JOB_REQUEST: the job reads it back as sent
    assert parse_request(op.job, sent) == spec.request, op.job
print(heavy["evaluate.evaluate_checkpoint"].entrypoint)
heavy_mods = sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)
assert not heavy_mods, heavy_mods
print("ok")
"""


def test_heavy_task_requests_are_built_without_torch(tmp_path: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(configure_airflow_env())}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "plugins"), str(ROOT / "dags"), env.get("PYTHONPATH", "")]
    )
    code = f"WORK = {str(tmp_path)!r}\n{_CODE}"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ok" and lines[-2] == "python -m rlhf_ops.cli pipeline-job evaluate"
