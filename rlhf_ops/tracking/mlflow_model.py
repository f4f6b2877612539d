"""An HF export as an MLflow Model (the ``transformers`` flavour, with ``python_function``), built without loading it.

``mlflow.transformers.save_model`` takes a local checkpoint folder: it copies the folder as the model binary
(``model/``), saves the tokenizer as a component and writes ``MLmodel`` with the ``text-generation`` task; the
weights are never read into memory. So the registered champion loads with ``mlflow.pyfunc.load_model`` (a
text-generation pipeline: strings in, strings out) and ``mlflow models serve``, and its ``model/`` folder is still
a plain HF folder for ``from_pretrained`` (the warm start reads it).

The export's ``README.md`` becomes the MLflow model card (``model_card.md``). The pip requirements are the installed
``transformers``, ``torch``, ``tokenizers`` and ``safetensors``; MLflow's own inference would import the model.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

TASK = "text-generation"
REQUIREMENTS = ("transformers", "torch", "tokenizers", "safetensors")
GENERATION_PARAMS = (("max_new_tokens", "long", 64), ("do_sample", "boolean", False), ("temperature", "double", 1.0))
"""Generation settings a caller may pass as ``params`` to ``predict`` (name, MLflow type, default)."""


def _pinned(package: str) -> str:
    try:
        return f"{package}=={importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


def save_transformers_model(hf_dir: str | Path, dest: str | Path) -> Path:
    """Writes the HF folder ``hf_dir`` as an MLflow Model folder ``dest`` (must not exist).

    Raises:
        ValueError: ``hf_dir`` is not an HF model folder (no ``config.json``).
    """
    import mlflow.transformers
    from huggingface_hub import ModelCard as HubModelCard
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    src, out = Path(hf_dir), Path(dest)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json; pass an HF export folder (rlhf export)")
    readme = src / "README.md"
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec(name, kind, default) for name, kind, default in GENERATION_PARAMS]),
    )
    mlflow.transformers.save_model(
        transformers_model=str(src),  # a local checkpoint: copied as is, never loaded
        path=str(out),
        task=TASK,
        save_pretrained=True,
        signature=signature,
        model_card=HubModelCard(readme.read_text()) if readme.is_file() else None,
        pip_requirements=[_pinned(p) for p in REQUIREMENTS],
    )
    # MLflow's fallback licence note points at huggingface.co/<the local path>; the card names the base model.
    (out / "LICENSE.txt").unlink(missing_ok=True)
    return out
