"""Link URL builders, plugin registration, plugin-folder loading and operator serialisation of the links."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_airflow.links import CheckpointFolderLink, MlflowRunLink, RayJobLink, checkpoint_browser_url, ray_job_url

PLUGINS_DIR = Path(__file__).resolve().parents[3] / "plugins"


def test_ray_job_url() -> None:
    assert (
        ray_job_url("http://127.0.0.1:8265/", "af-d-r-t-0123456789")
        == "http://127.0.0.1:8265/#/jobs/af-d-r-t-0123456789"
    )


@pytest.mark.parametrize(
    ("url", "template", "expected"),
    [
        ("file:///data/ckpt/exp/run/", None, "file:///data/ckpt/exp/run/"),
        ("s3://bucket/exp/run", None, "s3://bucket/exp/run"),
        ("hdfs://nn/ckpt", "https://console/{bucket}", "hdfs://nn/ckpt"),
        (
            "s3://rlhf-ckpt/exp 1/run/",
            "https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={key}/",
            "https://s3.console.aws.amazon.com/s3/buckets/rlhf-ckpt?prefix=exp%201/run/",
        ),
        (
            "s3://rlhf-ckpt/exp/run",
            "http://127.0.0.1:9001/browser/{bucket}/{key}",
            "http://127.0.0.1:9001/browser/rlhf-ckpt/exp/run",
        ),
    ],
)
def test_checkpoint_browser_url(url: str, template: str | None, expected: str) -> None:
    assert checkpoint_browser_url(url, s3_console_template=template) == expected


def test_rlhf_plugin_is_registered_once_with_the_three_links() -> None:
    from airflow._shared.plugins_manager.plugins_manager import _load_plugins_from_plugin_directory

    from rlhf_airflow.operators import RayJobOperator
    from rlhf_airflow.plugin import RlhfPlugin
    from rlhf_airflow.task_jobs import RayTaskJobOperator
    from rlhf_airflow.versions import PROVIDER_DISTRIBUTION, installed

    # Load the folder the way Airflow does (each .py file becomes a top-level module named after it).
    plugins, errors = _load_plugins_from_plugin_directory(str(PLUGINS_DIR))
    assert errors == {}
    # rlhf_airflow/.airflowignore keeps Airflow from importing hooks.py, operators.py… as top-level modules.
    loaded = [(type(p).__name__, Path(getattr(p.source, "path", "")).name) for p in plugins]
    if installed(PROVIDER_DISTRIBUTION):  # the installed provider registers it (provider info): never twice
        assert loaded == []
        plugin = RlhfPlugin()
    else:  # a source checkout: the plugins folder's rlhf_plugin.py does
        assert loaded == [("RlhfPlugin", "rlhf_plugin.py")]
        plugin = plugins[0]
    assert plugin.name == "rlhf"
    links = plugin.operator_extra_links
    assert [type(link) for link in links] == [RayJobLink, MlflowRunLink, CheckpointFolderLink]
    assert all(link.operators == [RayJobOperator, RayTaskJobOperator] for link in links)
    # Same names as the operator's own links, so the plugin's (DB-reading) versions win in the API server.
    assert {link.name for link in links} == {link.name for link in RayJobOperator.operator_extra_links}


def test_serialised_operator_keeps_link_names_and_xcom_keys() -> None:
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import OperatorSerialization

    from rlhf_airflow.operators import RayJobOperator

    with DAG("links_dag", schedule=None):
        op = RayJobOperator(task_id="train", entrypoint="echo hi", ray_conn_id="ray_default")
    encoded = OperatorSerialization.serialize_operator(op)
    assert encoded["_operator_extra_links"] == {
        "Ray job": "_link_RayJobLink",
        "MLflow run": "_link_MlflowRunLink",
        "Checkpoints": "_link_CheckpointFolderLink",
    }
    assert encoded["_task_module"] == "rlhf_airflow.operators" and encoded["task_type"] == "RayJobOperator"
