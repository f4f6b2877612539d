"""The heavy-task recipe, exercised: a throw-away job from outside the package (``tests/support/extension_job.py``:
request, result, body and Asset in one module) selected by dotted path, run through the real path. The Airflow side
builds the typed request from the task's values and the form, the Ray job's own command line (``rlhf pipeline-job
<dotted path>``) runs the body, and the task reads the result back from the run's remote store, validates it and puts
the request's extras on the job's Asset event. Only the Ray Jobs API in between is left out: the job's command runs
as a subprocess, as the Ray job's driver would (``tests/integration/test_ray_job_operator.py`` covers the API)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.airflow_env import configure_airflow_env

ROOT = Path(__file__).resolve().parents[3]

_CODE = """
import json, os, shlex, subprocess, sys, types
from collections import defaultdict
import pendulum
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowSkipException
from rlhf_airflow.pipeline.assets import pipeline_asset
from rlhf_airflow.pipeline.factory import heavy_task
from rlhf_airflow.pipeline.params import pipeline_params

JOB = "tests.support.extension_job:count_words"
with DAG("recipe", schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), params=pipeline_params(None)):
    op = heavy_task("count_words", job=JOB, dag_id="recipe", request={"text": "one two three"})  # the DAG's line
assert shlex.split(op.entrypoint) == ["python", "-m", "rlhf_ops.cli", "pipeline-job", JOB]
assert [a.name for a in op.outlets] == ["recipe.word_count"]  # the job's Asset, from its entry
params = {k: op.dag.params[k] for k in op.dag.params}
params.update(work_dir=WORK, remote_store_url=STORE)
events = defaultdict(lambda: types.SimpleNamespace(extra={}))
ctx = {"dag": op.dag, "run_id": "manual__1", "params": params, "outlet_events": events}
spec = op.request_for(op.request, ctx)
assert type(spec.request).__name__ == "CountWordsRequest" and spec.request.preset == "tiny-cpu"
try:
    op.request_for({"text": ""}, ctx)
    raise AssertionError("not skipped")
except AirflowSkipException as exc:
    assert "no text to count" in str(exc)
env = {**os.environ, "RLHF_JOB_REQUEST": spec.request.model_dump_json(), "RLHF_SUBMISSION_ID": "af-recipe-1"}
command = [sys.executable, *shlex.split(op.entrypoint)[1:]]  # the Ray node's python: this one
ray_side = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
assert ray_side.returncode == 0, ray_side.stderr[-2000:]
value = op.execute_complete(ctx, event={"status": "success", "submission_id": "af-recipe-1"})
assert value["words"] == 3 and open(value["written"]).read() == "3\\n"
assert value["written"].startswith(WORK)  # the job's own side of the run's folders
assert events[pipeline_asset("recipe", "word_count")].extra == {"words": 3, "preset": "tiny-cpu"}
assert not [m for m in ("torch", "transformers") if m in sys.modules]
print("ok")
"""


def test_a_user_job_by_dotted_path_runs_as_a_heavy_task(tmp_path: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(configure_airflow_env()), "RLHF_ALLOWED_CODE_MODULES": "tests.support"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "plugins"), str(ROOT / "dags"), env.get("PYTHONPATH", "")]
    )
    work, store = tmp_path / "ray", (tmp_path / "store").as_uri()
    code = f"WORK = {str(work)!r}\nSTORE = {store!r}\n{_CODE}"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok"
