"""Model registry: register every final model as a version; move the champion alias when told to.

Policy: each pipeline run's chosen model becomes a new version of the registered model (the audit trail
keeps every candidate with its eval metric in version tags, ``rlhf.eval_metric_name`` /
``rlhf.eval_metric_value``). Whether the alias (``champion``) moves is decided by
``rlhf_ops.pipeline.champion`` (a paired test over prompts), which then calls :func:`move_alias`.

Models are registered as MLflow Models (``runs:/<run_id>/model``, written by ``MlflowLogger.log_mlflow_model``):
the ``transformers`` flavour saved from the HF export folder without loading it, so
``mlflow.pyfunc.load_model("models:/<name>@champion")`` and ``mlflow models serve`` load the champion. Its
``model/`` subfolder is the plain HF folder: the warm start fetches the version with ``download_model`` and
calls ``from_pretrained`` on it.

The read-compare-set of the alias is not atomic in MLflow; two pipelines registering the same
model at the same moment could both win. Run ``register_model`` with an Airflow pool of size 1.
"""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

TAG_METRIC_NAME = "rlhf.eval_metric_name"
TAG_METRIC_VALUE = "rlhf.eval_metric_value"
TAG_PROMOTED = "rlhf.promoted"
TAG_PREVIOUS_CHAMPION = "rlhf.previous_champion"


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _existing_version(client: MlflowClient, name: str, run_id: str, model_uri: str) -> ModelVersion | None:
    """The version a previous try of this task registered for the same run and source, if any."""
    found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    matches = [v for v in found if v.source == model_uri]
    return min(matches, key=lambda v: int(v.version)) if matches else None


def _champion(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    if alias not in client.get_registered_model(name).aliases:
        return None
    return client.get_model_version_by_alias(name, alias)


def _register_version(
    client: MlflowClient, name: str, run_id: str, model_uri: str, metric_name: str, value: float
) -> ModelVersion:
    """Create the version (tagged with its metric), or reuse the one a previous try created."""
    _ensure_registered_model(client, name)
    tags = {TAG_METRIC_NAME: metric_name, TAG_METRIC_VALUE: repr(value)}
    version = _existing_version(client, name, run_id, model_uri)
    if version is None:
        return client.create_model_version(name, source=model_uri, run_id=run_id, tags={**tags, TAG_PROMOTED: "false"})
    for key, tag_value in tags.items():
        client.set_model_version_tag(name, version.version, key, tag_value)
    return version


def register_candidate(
    *,
    run_id: str,
    model_uri: str,
    registered_name: str,
    metric_name: str,
    metric_value: float,
    tracking_uri: str | None,
) -> tuple[ModelVersion, ModelVersion | None]:
    """Register ``model_uri`` as a new version (or reuse a retry's) and return it with the current champion.

    The caller decides whether the alias moves (``rlhf_ops.pipeline.champion``: a paired test over prompts).
    """
    if "'" in registered_name or "'" in run_id:
        raise ValueError(f"registered_name {registered_name!r} and run_id must not contain quotes")
    client = MlflowClient(tracking_uri=tracking_uri)
    version = _register_version(client, registered_name, run_id, model_uri, metric_name, float(metric_value))
    return version, _champion(client, registered_name, "champion")


def move_alias(
    *, registered_name: str, version: str, previous: str | None, alias: str = "champion", tracking_uri: str | None
) -> None:
    """Point ``alias`` at ``version`` and tag it promoted (with the version it replaced)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    client.set_registered_model_alias(registered_name, alias, version)
    client.set_model_version_tag(registered_name, version, TAG_PROMOTED, "true")
    if previous is not None:
        client.set_model_version_tag(registered_name, version, TAG_PREVIOUS_CHAMPION, previous)


def download_model(
    *,
    registered_name: str,
    dst_path: str | Path,
    alias: str = "champion",
    version: str | None = None,
    tracking_uri: str | None = None,
) -> Path:
    """Download the folder of ``version`` (default: the version that ``alias`` points to); returns the local folder.

    Resolves the version with an explicit client because MLflow 3.17's ``models:/`` resolution ignores
    the ``registry_uri`` argument of ``mlflow.artifacts.download_artifacts`` and uses the global URI. Pass the
    ``version`` already resolved when the alias may move meanwhile (another run promoting its model).
    """
    import mlflow.artifacts

    client = MlflowClient(tracking_uri=tracking_uri)
    if version is None:
        version = str(client.get_model_version_by_alias(registered_name, alias).version)
    source_uri = client.get_model_version_download_uri(registered_name, version)
    Path(dst_path).mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=source_uri, dst_path=str(dst_path), tracking_uri=client.tracking_uri
    )
    return Path(local)
