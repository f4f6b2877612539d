"""Both wheels installed into a stack the project does not develop on, as a platform team would.

The Airflow side: a venv with Airflow 3.1 (the project develops on 3.3), no torch, and the provider wheel installed
alone (it pulls the library's torch-free core). The Ray side: a cluster whose Python holds only the library wheel
with its ``train`` extra at the versions of constraints/ci.txt (no Airflow). Neither side sees this repository's
sources (no PYTHONPATH): they import what the wheels installed. MLflow and moto S3 run from the development venv,
as services.

The venvs are cached under ~/.cache/rlhf-ops/foreign-venvs/<hash> (tests/support/foreign_stack.py): the first run
builds them from the package index (~8 minutes), a repeat only reinstalls the two fresh wheels.
The pipeline run itself takes
3-4 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.pipeline.local_stack import start_ray_head
from tests.support.foreign_stack import FOREIGN_AIRFLOW, ROOT, airflow_venv, build_wheels, ray_venv
from tests.support.mlflow_server import mlflow_server
from tests.support.moto_server import REGION, running_moto_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

RUNNER = ROOT / "tests" / "support" / "foreign_airflow_run.py"
BUCKET = "rlhf-foreign"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two venvs (built or reused) holding the freshly built wheels, and an Airflow home with the DAG files."""
    wheels = build_wheels(tmp_path_factory.mktemp("wheels"))
    home = tmp_path_factory.mktemp("airflow_home")
    shutil.copytree(ROOT / "dags", home / "dags")
    (home / "plugins").mkdir()
    stack = {"airflow": airflow_venv(wheels), "ray": ray_venv(wheels), "home": home, "wheels": wheels}
    _airflow(stack, ["db", "migrate"], timeout=300)
    return stack


def _clean_env(python: Path) -> dict[str, str]:
    """This process's environment without its sources and venv: only ``python``'s venv on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("_RLHF")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _airflow_env(stack: dict[str, Any], extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in _clean_env(stack["airflow"]).items() if not k.startswith("AIRFLOW")}
    home = stack["home"]
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        }
    )
    return env | (extra or {})


def _airflow(
    stack: dict[str, Any], args: list[str], *, timeout: float = 120, env: dict[str, str] | None = None
) -> str:
    result = subprocess.run(
        [str(stack["airflow"].with_name("airflow")), *args],
        env=_airflow_env(stack, env),
        cwd=stack["home"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _run(stack: dict[str, Any], *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    result = subprocess.run(
        [str(stack["airflow"]), str(RUNNER), *args],
        env=_airflow_env(stack, env),
        cwd=stack["home"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _json_rows(text: str) -> list[dict[str, Any]]:
    return json.loads(text[text.index("[") :])


def test_provider_is_listed_with_the_ray_connection_type_next_to_another_airflow(stack: dict[str, Any]) -> None:
    providers = {
        row["package_name"]: row["version"] for row in _json_rows(_airflow(stack, ["providers", "list", "-o", "json"]))
    }
    assert providers["airflow-provider-rlhf"] == "0.1.0"
    hooks = {row["connection_type"]: row for row in _json_rows(_airflow(stack, ["providers", "hooks", "-o", "json"]))}
    assert hooks["ray"]["class"] == "rlhf_airflow.hooks.RayJobHook"
    seen = _run(stack, "inspect", str(stack["home"] / "dags"))
    assert seen["airflow"] == FOREIGN_AIRFLOW
    assert seen["ray_hook"] == ["rlhf_airflow.hooks.RayJobHook", "Ray Jobs", True]  # testable: the Test button
    assert seen["ui_field_behaviour"]["relabeling"]["password"] == "Ray auth token"
    assert seen["plugins"] == ["rlhf"]
    assert seen["import_errors"] == {}
    assert {"rlhf_ppo", "rlhf_champion_report"} <= set(seen["dags"])
    assert seen["heavy_modules"] == []
    no_torch = subprocess.run(
        [
            str(stack["airflow"]),
            "-c",
            "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('rlhf_ops'))",
        ],
        env=_clean_env(stack["airflow"]),
        cwd=stack["home"],  # not the repository: its sources must not be importable
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert no_torch.startswith("None ") and "site-packages" in no_torch  # the library from the wheel, no torch


def test_connection_form_shows_the_ray_fields_without_fab(stack: dict[str, Any]) -> None:
    """What the UI's connection form receives for ``ray`` on Airflow 3.1, whose venv has no FAB provider."""
    fab = subprocess.run(
        [str(stack["airflow"]), "-c", "import importlib.util as u; print(u.find_spec('airflow.providers.fab'))"],
        env=_clean_env(stack["airflow"]),
        cwd=stack["home"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert fab == "None"
    form = _run(stack, "hook-meta")["ray"]
    assert form["hook_name"] == "Ray Jobs" and form["hook_class_name"] == "rlhf_airflow.hooks.RayJobHook"
    standard = form["standard_fields"]
    assert standard["password"]["title"] == "Ray auth token" and standard["login"]["hidden"] is True
    assert standard["host"]["title"] == "Ray dashboard host" and standard["port"]["placeholder"] == "8265"
    extra = form["extra_fields"]
    assert sorted(extra) == ["headers", "verify"]
    # Without WTForms/FAB, Airflow 3.1 shows the field but not its default; the hook reads "" or absent as true.
    assert extra["verify"]["schema"]["title"] == "TLS verify" and extra["verify"]["value"] in ("true", None)
    assert extra["headers"]["schema"]["title"] == "Extra HTTP headers (JSON)"


def test_test_button_names_a_ray_connection_that_does_not_answer(stack: dict[str, Any]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conn = json.dumps({"conn_type": "ray", "host": "127.0.0.1", "port": port})
    result = _run(stack, "test-connection", env={"AIRFLOW_CONN_RAY_DEFAULT": conn})
    assert result["ok"] is False
    assert result["message"].startswith(f"the Ray job server at http://127.0.0.1:{port} does not answer")


@pytest.fixture(scope="module")
def services(stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Moto S3 and MLflow (development venv), a Ray head on the Ray venv; the Airflow connections as env vars."""
    saved = dict(os.environ)
    os.environ.pop("PYTHONPATH", None)  # the Ray head and its jobs import the library wheel, not these sources
    os.environ.update(
        {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    )
    token = secrets.token_hex(16)
    try:
        with running_moto_server() as moto, mlflow_server(root=tmp_path_factory.mktemp("mlflow")) as tracking_uri:
            moto.create_bucket(BUCKET)
            # The cluster's own identity (the default: no credential is forwarded to a job): the Ray head's own
            # environment holds the store's keys, as a node role or a mounted secret would provide them.
            os.environ.update({"AWS_ACCESS_KEY_ID": "ray-node", "AWS_SECRET_ACCESS_KEY": "ray-node-secret"})
            head = start_ray_head(tmp_path_factory.mktemp("ray"), auth_token=token, num_cpus=2, python=stack["ray"])
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                os.environ.pop(name)
            port = int(head.url.rsplit(":", 1)[1])
            conns = {
                "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
                    {"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token}
                ),
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": tracking_uri}),
                "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                    {
                        "conn_type": "aws",
                        "login": "testing",
                        "password": "testing",
                        "extra": {"endpoint_url": moto.endpoint_url, "region_name": REGION},
                    }
                ),
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            }
            try:
                yield {"dashboard": head.url, "conns": conns, "token": token}
            finally:
                head.stop()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_test_button_reaches_the_ray_cluster(stack: dict[str, Any], services: dict[str, Any]) -> None:
    result = _run(stack, "test-connection", env=services["conns"])
    assert result == {"ok": True, "message": f"Ray 2.60.0 job server at {services['dashboard']}"}


# Slow: ~120 s on an AVX2-only host; the provider's install, listing and connection test stay in the default suite.
@pytest.mark.slow
def test_rlhf_ppo_runs_with_dag_test_on_the_foreign_stack(
    stack: dict[str, Any], services: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    conf = {
        "preset": "tiny-cpu",
        "work_dir": str(tmp_path_factory.mktemp("work")),
        "remote_store_url": f"s3://{BUCKET}/runs",
        "ray_address": services["dashboard"],
        "total_training_steps": 2,
        "save_freq": 2,
        "eval_n_samples": 1,
        "eval_max_prompts": 8,
        "eval_engine": "hf",
        "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false"],
    }
    dags = str(stack["home"] / "dags")
    result = _run(stack, "dag-test", dags, json.dumps(conf), env=services["conns"], timeout=1200)
    states = result.get("states", result)
    assert result.get("state") == "success", states
    assert states.pop("fetch_champion[-1]") == "skipped", states  # warm_start: scratch
    assert set(states.values()) == {"success"}, states
    assert result["heavy_modules"] == []  # and there is no torch to import in that venv at all
