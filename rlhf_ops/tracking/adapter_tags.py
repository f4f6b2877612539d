"""Which base model a registered LoRA adapter needs, as tags of its MLflow registered model version.

A LoRA run's export holds the merged model and, in ``adapter/``, the PEFT adapter alone; the adapter is only
usable on the exact base weights it was trained on. The ``register_model`` task records them on the version:

- ``rlhf.adapter_base_model``: the base as the run named it (``model.path``: a built-in, a hub id or a folder);
- ``rlhf.adapter_base_model_sha256``: SHA-256 of the base's weight files (``*.safetensors``, in name order: each
  file's name, then its bytes), the identity of the weights whatever the base's name;
- ``rlhf.adapter_base_model_revision``: the base's revision where one is known: the commit of a Hugging Face
  cache snapshot (``.../snapshots/<commit>/``), or ``gguf-sha256:<digest>`` of the GGUF file a built-in was
  imported from;
- ``rlhf.adapter_path``: the adapter folder inside the version's artifacts (``model/adapter``).

A full fine-tune (no ``adapter/`` in the export) gets none of them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

__all__ = [
    "TAG_ADAPTER_BASE_MODEL",
    "TAG_ADAPTER_BASE_MODEL_REVISION",
    "TAG_ADAPTER_BASE_MODEL_SHA256",
    "TAG_ADAPTER_PATH",
    "adapter_version_tags",
    "base_model_sha256",
]

TAG_ADAPTER_BASE_MODEL = "rlhf.adapter_base_model"
TAG_ADAPTER_BASE_MODEL_SHA256 = "rlhf.adapter_base_model_sha256"
TAG_ADAPTER_BASE_MODEL_REVISION = "rlhf.adapter_base_model_revision"
TAG_ADAPTER_PATH = "rlhf.adapter_path"
ADAPTER_DIR = "adapter"  # rlhf_ops.checkpoint.adapter_export.ADAPTER_DIR
MLFLOW_MODEL_DIR = "model"  # the HF folder inside an MLflow transformers model
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_IMPORT_RECORD = "rlhf_import.json"  # rlhf_ops.models.gguf.IMPORT_RECORD


def base_model_sha256(base_model_path: str | Path) -> str:
    """SHA-256 over the base folder's ``*.safetensors`` (name order; each file's name then bytes).

    Raises:
        ValueError: the folder holds no safetensors weights.
    """
    files = sorted(Path(base_model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{base_model_path} has no *.safetensors weights to identify the adapter's base model; pass the base "
            "model's HF folder (model.path)"
        )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _revision(base_model_path: Path) -> str:
    snapshot = _SNAPSHOT.search(base_model_path.resolve().as_posix())
    if snapshot:
        return snapshot.group(1)
    record = base_model_path / _IMPORT_RECORD
    if record.is_file():
        source = json.loads(record.read_text()).get("source_sha256")
        if source:
            return f"gguf-sha256:{source}"
    return ""


def adapter_version_tags(export_dir: str | Path, *, base_model: str, base_model_path: str | Path) -> dict[str, str]:
    """The tags above for the export at ``export_dir`` ({} when it holds no adapter).

    Args:
        export_dir: The HF export (``rlhf export``), the adapter in ``adapter/``.
        base_model: ``model.path`` as the run's config names it.
        base_model_path: The local folder it resolves to (its weights are hashed).
    """
    if not (Path(export_dir) / ADAPTER_DIR / "adapter_config.json").is_file():
        return {}
    base = Path(base_model_path)
    tags = {
        TAG_ADAPTER_BASE_MODEL: base_model,
        TAG_ADAPTER_BASE_MODEL_SHA256: base_model_sha256(base),
        TAG_ADAPTER_PATH: f"{MLFLOW_MODEL_DIR}/{ADAPTER_DIR}",
    }
    revision = _revision(base)
    if revision:
        tags[TAG_ADAPTER_BASE_MODEL_REVISION] = revision
    return tags
