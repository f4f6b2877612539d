"""Which model entries a role checkpoint holds: every weight, or the LoRA adapters only.

With ``model.lora.save_adapter_only`` the checkpoint keeps the trainable parameters (the adapters) and their
optimizer state; the frozen base weights are not written, since every run rebuilds them from ``model.path``.
On load, the entries the checkpoint holds decide (its DCP metadata, not the current config), so a full
checkpoint and an adapter-only one both resume a LoRA run, and a missing trainable entry is an error.

Every LoRA checkpoint also holds ``adapter_config.json``: PEFT's config of the adapters (rank, alpha, targets,
base model), which the export copies into the adapter folder it writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from rlhf_ops.checkpoint.dcp_reader import ADAPTER_CONFIG_FILE, MODEL_KEY, SafeFileSystemReader

__all__ = [
    "checkpoint_model_keys",
    "restrict_to_checkpoint",
    "select_adapter_entries",
    "trainable_names",
    "write_adapter_config",
]


def trainable_names(module: nn.Module) -> set[str]:
    """Names of the parameters that train (under LoRA: the adapters), as the state dict names them."""
    return {name for name, param in module.named_parameters() if param.requires_grad}


def select_adapter_entries(model_sd: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """The entries of ``model_sd`` that train; ``ValueError`` for a model without PEFT adapters."""
    keep = trainable_names(module)
    selected = {name: value for name, value in model_sd.items() if name in keep}
    if not selected or not isinstance(getattr(module, "peft_config", None), dict):
        raise ValueError(
            "model.lora.save_adapter_only is set but the model has no trainable adapter; set model.lora.rank > 0"
        )
    return selected


def checkpoint_model_keys(path: str) -> set[str]:
    """Names of the model entries a role checkpoint at ``path`` holds (read from its DCP metadata)."""
    metadata = SafeFileSystemReader(path).read_metadata()
    keys = set()
    for flat_key in metadata.state_dict_metadata:
        nested = metadata.planner_data.get(flat_key, ())
        if len(nested) == 2 and nested[0] == MODEL_KEY:
            keys.add(str(nested[1]))
    return keys


def restrict_to_checkpoint(model_sd: dict[str, Any], module: nn.Module, path: str) -> tuple[dict[str, Any], bool]:
    """``model_sd`` cut to the entries saved at ``path``, and whether the checkpoint is adapter-only.

    Raises:
        ValueError: A trainable parameter is not in the checkpoint (another model or LoRA config).
    """
    saved = checkpoint_model_keys(path)
    if set(model_sd) <= saved:
        return model_sd, False
    missing = sorted(trainable_names(module) - saved)
    if missing:
        raise ValueError(
            f"{path} lacks trained weights of this model ({missing[0]!r} and {len(missing) - 1} more); resume from "
            "a checkpoint of the same model and model.lora settings"
        )
    return {name: value for name, value in model_sd.items() if name in saved}, True


def write_adapter_config(module: nn.Module, folder: Path) -> bool:
    """Writes PEFT's ``adapter_config.json`` of ``module``'s default adapter into ``folder``; False if not PEFT.

    ``base_model_name_or_path`` is the folder the base was loaded from; the export replaces it with the base
    model it was given.
    """
    peft_config = getattr(module, "peft_config", None)
    if not isinstance(peft_config, dict) or "default" not in peft_config:
        return False
    config = peft_config["default"].to_dict()
    for key, value in list(config.items()):
        if isinstance(value, set):  # target_modules is a set after PEFT resolved it
            config[key] = sorted(value)
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return True
