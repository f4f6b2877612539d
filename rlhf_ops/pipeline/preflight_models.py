"""Pre-flight checks of the policy's architecture: what the installed libraries cannot train or roll out exactly.

The platform trains any causal LM that transformers builds and, with ``rollout.engine=vllm``, that vLLM implements
(the weights are synced into vLLM by name through its own ``load_weights``). Tested architectures:
``docs/models.md``. A config that cannot work is refused here with the reason, before any worker starts:

- ``rollout.engine=vllm`` with an architecture the installed vLLM has no implementation of (read from vLLM's
  model registry file, without importing vLLM: importing it takes ~20 s);
- attention soft-capping (Gemma 2: ``attn_logit_softcapping``) with ``model.attn_implementation=sdpa``: the SDPA
  kernel has no soft-capping, transformers drops it silently, so the actor's log-probs would differ from the
  rollout's (vLLM applies it) and from the model's own.

Torch-free (the Airflow ``preflight`` task runs it): config.json is read as JSON, vLLM's registry as source text.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from rlhf_ops.config import RunConfig
from rlhf_ops.pipeline.preflight_checks import Problem

_VLLM_REGISTRY_DICTS = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")


@functools.cache
def vllm_architectures() -> frozenset[str] | None:
    """Architectures (``config.json``'s ``architectures`` names) the installed vLLM implements; None without vLLM.

    Read from ``vllm/model_executor/models/registry.py`` with ``ast`` (the string keys of its text-generation and
    multimodal tables), so pre-flight does not pay vLLM's import.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    registry = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(registry.read_text())
    except (OSError, SyntaxError):
        return None
    names: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        value = node.value if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in _VLLM_REGISTRY_DICTS and isinstance(value, ast.Dict):
            names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset(names) or None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def check_architecture(config: RunConfig) -> list[Problem]:
    """Problems of the policy's architecture with this run's engines and attention (empty: it can run)."""
    path = config.model.path
    config_file = Path(path) / "config.json"
    if path.startswith("builtin:") or not config_file.is_file():
        return []  # built-ins are tested; a missing folder is check_model_dir's line
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return []  # check_model_dir reports it
    if not isinstance(hf, dict):
        return []
    problems: list[Problem] = []
    model_type = str(hf.get("model_type", ""))
    archs = [str(a) for a in hf.get("architectures") or []]
    supported = vllm_architectures() if config.rollout.engine == "vllm" else None
    if supported is not None and archs and not any(a in supported for a in archs):
        problems.append(
            Problem(
                "rollout.engine",
                f"the installed vLLM has no implementation of {', '.join(archs)} ({config_file}), so the weight "
                "sync into it cannot work",
                "set rollout.engine=hf, or install a vLLM release that lists the architecture",
            )
        )
    softcap = _text_config(hf).get("attn_logit_softcapping")
    if softcap is not None and config.model.attn_implementation == "sdpa":
        problems.append(
            Problem(
                "model.attn_implementation",
                f"sdpa has no attention soft-capping, which {', '.join(archs) or model_type} uses "
                f"(attn_logit_softcapping={softcap}): transformers drops it silently and the log-probs would be "
                "those of another model",
                "set model.attn_implementation=eager (or flash_attention_2 on GPUs)",
            )
        )
    return problems
