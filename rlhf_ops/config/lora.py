"""The LoRA section of the model config (its pre-flight rules: :mod:`rlhf_ops.config.lora_rules`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ops.config.section import Section

LoraSync = Literal["auto", "adapter", "merged"]
LORA_SYNC_DOC = (
    "How a LoRA policy reaches the rollout engine before each rollout. 'adapter': the adapters only "
    "(PEFT format, vLLM's LoRA: the engine serves the base from model.path plus a new adapter per policy "
    "version); 'merged': every weight with W + scale * B @ A folded in; 'auto': 'adapter' on GPU with "
    "model.lora.rank > 0, rollout.engine=vllm and rollout.mode=sync (as verl), else 'merged' (on CPU vLLM's LoRA "
    "kernels slow generation more than the smaller sync saves)."
)


class LoraConfig(Section):
    """PEFT LoRA adapters on the actor. ``rank=0`` disables LoRA (full fine-tuning)."""

    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains all weights.")
    alpha: int = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA path.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )
    save_adapter_only: bool = Field(
        False,
        description="Checkpoints hold the adapters and their optimizer state only (not the frozen base weights); "
        "resume rebuilds the base from model.path. The HF export still writes the merged model, plus its adapter "
        "folder. Needs rank > 0 (verl: actor_rollout_ref.actor.checkpoint.save_lora_only).",
    )
