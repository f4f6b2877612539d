"""Model builders: the tiny Llama-style policy (``builtin:tiny-llama``) of tests, demos and the learning test.

The names are loaded on first use (PEP 562): config validation imports ``rlhf_ops.models.modality``, and
the Airflow side must not import torch through this package.
"""

from typing import Any

__all__ = ["TINY_MODEL_DEFAULTS", "build_tiny_model_dir", "build_tiny_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlhf_ops.models import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module 'rlhf_ops.models' has no attribute {name!r}")
