"""The prepared training and validation files as MLflow dataset inputs of the pipeline's run.

``prepare_data`` writes ``train.parquet`` and ``val.parquet`` with a manifest holding each file's sha256 and row
count. Each file is logged as an MLflow dataset input (the run page's "Datasets used", and ``run.inputs``) with its
source (the file's URL, credentials masked), its digest (the file's sha256, first 16 hex digits, so a re-prepared
identical file has the same digest) and its context (``training`` / ``validation``). The files are not read:
a ``MetaDataset`` carries the metadata only, so the task stays light whatever the data's size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

DATASET_FILES = (("train.parquet", "train_url", "training"), ("val.parquet", "val_url", "validation"))
DIGEST_CHARS = 16


def _source(url: str) -> Any:
    """The MLflow dataset source of ``url``: its registered resolver (local, s3, hdfs, gs...) or a URL source."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.exceptions import MlflowException

    try:
        return resolve_dataset_source(url)
    except MlflowException:  # a scheme MLflow has no resolver for (webhdfs://, memory://): keep the URL as is
        return HTTPDatasetSource(url=url)


def dataset_inputs(prepared: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[Any]:
    """``DatasetInput`` entities of the prepared files that ``prepared`` locates and ``manifest`` describes.

    Args:
        prepared: ``prepare_data``'s result (``train_url``, ``val_url``, ``run_id``).
        manifest: Its ``manifest.json`` (``files``: ``{name: {"sha256", "num_rows"}}``).
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from rlhf_ops.tracking.params import redact_value

    files = manifest.get("files") or {}
    inputs = []
    for name, url_key, context in DATASET_FILES:
        info, url = files.get(name), prepared.get(url_key)
        if not isinstance(info, Mapping) or not url or not info.get("num_rows"):
            continue  # an empty split (no validation rows) is not an input
        stem = name.split(".", 1)[0]
        source = _source(redact_value(str(url)))
        # The entity itself, not mlflow.data's MetaDataset: that needs numpy (mlflow.types.Schema), which the
        # provider's torch-free Airflow side (mlflow-skinny) does not have.
        dataset = Dataset(
            name=f"{prepared.get('run_id') or 'data'}/{stem}",
            digest=str(info.get("sha256", ""))[:DIGEST_CHARS] or hashlib.sha256(str(url).encode()).hexdigest()[:8],
            source_type=source._get_source_type(),
            source=source.to_json(),
        )
        inputs.append(DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    return inputs


def log_dataset_inputs(
    run_id: str, prepared: Mapping[str, Any], manifest: Mapping[str, Any], *, tracking_uri: str | None
) -> int:
    """Logs the prepared files as dataset inputs of ``run_id`` (a retry logs the same entries again: MLflow keeps
    one per digest and context); returns how many were logged."""
    from mlflow import MlflowClient

    inputs = dataset_inputs(prepared, manifest)
    if inputs:
        MlflowClient(tracking_uri=tracking_uri).log_inputs(run_id, datasets=inputs)
    return len(inputs)
