"""Cross-field rules of adapter-only LoRA (``model.lora.save_adapter_only`` / ``sync_adapter_only``), called by
:mod:`rlhf_ops.config.validate`.

Both keys act on the PEFT adapters, so they need ``model.lora.rank > 0``. Sending the adapters alone to the
rollout engine needs an engine that applies LoRA at generation time (vLLM's ``LoRARequest``, in the in-process
``sync`` engine) and keeps its base weights between rollouts: vLLM on CPU frees them with ``free_cache_engine``
and reloads whole weights at the next sync, which leaves nothing to save.
"""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import RunConfig

__all__ = ["lora_problems"]


def lora_problems(run: RunConfig) -> list[ConfigProblem]:
    """Problems of the adapter-only keys with LoRA's rank and the rollout engine."""
    lora, rollout = run.model.lora, run.rollout
    problems = []
    for key in ("save_adapter_only", "sync_adapter_only"):
        if getattr(lora, key) and lora.rank == 0:
            problems.append(
                ConfigProblem(
                    f"model.lora.{key}",
                    "keeps the LoRA adapters only, but model.lora.rank=0 trains every weight (there is no adapter)",
                    f"set model.lora.rank > 0 (e.g. 8), or model.lora.{key}=false",
                )
            )
    if not lora.sync_adapter_only or lora.rank == 0:
        return problems
    if rollout.engine != "vllm" or rollout.mode != "sync":
        problems.append(
            ConfigProblem(
                "model.lora.sync_adapter_only",
                f"sends a vLLM LoRARequest, but rollout.engine={rollout.engine} with rollout.mode={rollout.mode} "
                "has no adapter loading",
                "set rollout.engine=vllm and rollout.mode=sync, or model.lora.sync_adapter_only=false (merged "
                "weights are synced)",
            )
        )
        return problems
    if run.resources.device == "cpu" and rollout.free_cache_engine:
        problems.append(
            ConfigProblem(
                "model.lora.sync_adapter_only",
                "vLLM on CPU frees its base weights after each rollout (rollout.free_cache_engine=true), so every "
                "sync must send whole weights again",
                "set rollout.free_cache_engine=false, or model.lora.sync_adapter_only=false",
            )
        )
    return problems
