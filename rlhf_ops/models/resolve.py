"""Resolving ``model.path``: a local HF directory, or ``builtin:tiny-llama`` / ``builtin:tiny-vlm`` (built locally)."""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_TINY = "builtin:tiny-llama"
BUILTIN_TINY_VLM = "builtin:tiny-vlm"


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
    if path.startswith("builtin:"):
        raise ValueError(
            f"model.path: unknown built-in model {path!r}; use {BUILTIN_TINY!r}, {BUILTIN_TINY_VLM!r} or a local "
            "HF directory"
        )
    if not Path(path).is_dir():
        raise ValueError(
            f"model.path: {path!r} is not a local directory; download the HF model to a path every node can read "
            "(the platform never fetches from a hub at run time)"
        )
    return path
