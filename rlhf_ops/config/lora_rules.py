"""Cross-field rules of LoRA's keys, called by :mod:`rlhf_ops.config.validate`: adapter-only checkpoints
(``model.lora.save_adapter_only``) and the adapter-only weight sync (``rollout.lora_sync``) act on the PEFT
adapters, so they need ``model.lora.rank > 0``; the adapter sync needs an engine that serves LoRA adapters
(vLLM's in-process engine, ``rollout.mode=sync``). :func:`resolve_lora_sync` says what ``auto`` means: the
adapter on GPU, the merged weights on CPU, where vLLM's LoRA layers run PyTorch-native kernels that copy the
adapter's matrices for every token (SmolLM2-135M r=8: generation about twice as slow, more than the sync saves;
docs/lora_adapters.md).
"""

from __future__ import annotations

from typing import Literal

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.lora import LoraConfig
from rlhf_ops.config.schema import RolloutConfig, RunConfig

__all__ = ["ADAPTER_SYNC_ENGINES", "lora_problems", "resolve_lora_sync"]

Device = Literal["cpu", "cuda"]

ADAPTER_SYNC_ENGINES = frozenset({"vllm"})
"""Rollout engines that take an adapter alone (the base weights loaded from ``model.path`` at start-up)."""


def _adapter_sync_blocker(lora: LoraConfig, rollout: RolloutConfig) -> str:
    """Why the adapter sync cannot run with these settings ('' when it can)."""
    if lora.rank == 0:
        return "model.lora.rank=0 trains every weight (there is no adapter to send)"
    if rollout.engine not in ADAPTER_SYNC_ENGINES:
        return f"rollout.engine={rollout.engine} holds no LoRA adapters (only {sorted(ADAPTER_SYNC_ENGINES)} does)"
    if rollout.mode != "sync":
        return "rollout.mode=async loads weights through files in its engine process, not adapters"
    return ""


def resolve_lora_sync(lora: LoraConfig, rollout: RolloutConfig, device: Device) -> Literal["adapter", "merged"]:
    """``rollout.lora_sync`` made concrete: ``auto`` is ``adapter`` on GPU wherever the adapter sync can run."""
    if rollout.lora_sync == "merged":
        return "merged"
    if rollout.lora_sync == "adapter":
        return "adapter"
    return "merged" if device == "cpu" or _adapter_sync_blocker(lora, rollout) else "adapter"


def lora_problems(run: RunConfig) -> list[ConfigProblem]:
    """Problems of the adapter-only keys with LoRA's rank and the rollout engine."""
    lora, problems = run.model.lora, []
    if lora.save_adapter_only and lora.rank == 0:
        problems.append(
            ConfigProblem(
                "model.lora.save_adapter_only",
                "keeps the LoRA adapters only, but model.lora.rank=0 trains every weight (there is no adapter)",
                "set model.lora.rank > 0 (e.g. 8), or model.lora.save_adapter_only=false",
            )
        )
    blocker = _adapter_sync_blocker(lora, run.rollout)
    if run.rollout.lora_sync == "adapter" and blocker:
        problems.append(
            ConfigProblem(
                "rollout.lora_sync",
                f"adapter sends the LoRA adapters only, but {blocker}",
                "set rollout.lora_sync=auto (adapter where it can run, merged weights elsewhere) or merged",
            )
        )
    return problems
