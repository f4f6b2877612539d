"""Cross-field rules of adapter-only LoRA (``model.lora.save_adapter_only``), called by
:mod:`rlhf_ops.config.validate`: the key acts on the PEFT adapters, so it needs ``model.lora.rank > 0``.
"""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import RunConfig

__all__ = ["lora_problems"]


def lora_problems(run: RunConfig) -> list[ConfigProblem]:
    """Problems of the adapter-only key with LoRA's rank."""
    lora = run.model.lora
    if lora.save_adapter_only and lora.rank == 0:
        return [
            ConfigProblem(
                "model.lora.save_adapter_only",
                "keeps the LoRA adapters only, but model.lora.rank=0 trains every weight (there is no adapter)",
                "set model.lora.rank > 0 (e.g. 8), or model.lora.save_adapter_only=false",
            )
        ]
    return []
