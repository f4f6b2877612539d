"""LoRA adapters of a checkpoint as a PEFT adapter folder, and the base weights an adapter-only checkpoint lacks.

A LoRA checkpoint (``<ckpt>/<role>/adapter_config.json`` present) exports to the merged HF model and, inside it,
``adapter/``: ``adapter_config.json`` (PEFT's, with ``base_model_name_or_path`` set to the base model the export
was given) and ``adapter_model.safetensors`` (PEFT's saved names: ``base_model.model.<layer>.lora_A.weight``,
the adapter name dropped). ``PeftModel.from_pretrained(base, "<export>/adapter")`` and vLLM's ``LoRARequest``
load it as is.

An adapter-only checkpoint (``model.lora.save_adapter_only``) holds the adapters alone; the merged export reads
the base weights from the base model's safetensors (never a pickle) and names them as the PEFT model did
(``base_model.model.<name>``, ``<layer>.base_layer.weight`` for an adapted layer), so the merge is the one of a
full checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from torch import Tensor

from rlhf_ops.checkpoint.dcp_reader import ADAPTER_CONFIG_FILE

__all__ = ["ADAPTER_DIR", "is_adapter_only", "with_base_weights", "write_adapter_folder"]

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ADAPTER_NAME = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$")


def is_adapter_only(weights: dict[str, Tensor]) -> bool:
    """Whether a PEFT model's state dict holds its adapters but none of its base weights."""
    return any(_ADAPTER_NAME.search(n) for n in weights) and all(_ADAPTER_NAME.search(n) for n in weights)


def _base_state_dict(base_model_path: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    folder = Path(base_model_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no *.safetensors weights; an adapter-only checkpoint exports onto its base model's "
            "weights: pass the base model's HF folder (--base-model / model.path)"
        )
    weights: dict[str, Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def with_base_weights(adapters: dict[str, Tensor], base_model_path: str) -> dict[str, Tensor]:
    """The full PEFT-named state dict: the base model's weights plus ``adapters`` (an adapter-only checkpoint)."""
    adapted = {_ADAPTER_NAME.sub("", n).removeprefix(_PEFT_PREFIX) for n in adapters}  # HF layer names
    full = dict(adapters)
    for name, tensor in _base_state_dict(base_model_path).items():
        layer = name.removesuffix(".weight")
        peft_name = f"{layer}.base_layer.weight" if layer in adapted and name.endswith(".weight") else name
        if layer in adapted and name.endswith(".bias"):
            peft_name = f"{name.removesuffix('.bias')}.base_layer.bias"
        full[_PEFT_PREFIX + peft_name] = tensor
    missing = sorted(layer for layer in adapted if f"{_PEFT_PREFIX}{layer}.base_layer.weight" not in full)
    if missing:
        raise ValueError(
            f"the base model {base_model_path} has no weight for the adapted layer {missing[0]!r}; pass the base "
            "model the run trained (--base-model / model.path)"
        )
    return full


def write_adapter_folder(
    folder: Path, weights: dict[str, Tensor], *, role_dir: Path, base_model: str, adapter: str = "default"
) -> Path:
    """Writes PEFT's adapter folder (config + safetensors) of ``adapter`` from a PEFT model's state dict.

    Raises:
        ValueError: The checkpoint has no ``adapter_config.json`` (not a LoRA checkpoint).
    """
    from safetensors.torch import save_file

    config_file = role_dir / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(
            f"{role_dir} holds no LoRA adapters ({ADAPTER_CONFIG_FILE} missing): the run trained every weight "
            "(model.lora.rank=0); export the merged model only (without --adapter-only)"
        )
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_model
    suffix = f".{adapter}.weight"
    tensors = {
        name.removesuffix(suffix) + ".weight": tensor.contiguous()
        for name, tensor in weights.items()
        if _ADAPTER_NAME.search(name) and name.endswith(suffix)
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
