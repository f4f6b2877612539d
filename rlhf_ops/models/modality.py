"""Text or vision-language: which HF auto class builds the policy, decided from the model's config.

``model.modality`` is ``auto`` by default: a model directory whose ``config.json`` has a
``vision_config`` (LLaVA, Qwen2-VL, Gemma 3, SmolVLM, ...) is a vision-language model, loaded with
``AutoModelForImageTextToText`` (the successor of ``AutoModelForVision2Seq``); anything else is a causal LM
(``AutoModelForCausalLM``). The worker side (:func:`policy_auto_class`) decides from the loaded config, so
the two can never disagree; validation refuses an explicit ``model.modality`` that contradicts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Modality = Literal["text", "vision_language"]

BUILTIN_MODALITIES: dict[str, Modality] = {"builtin:tiny-llama": "text", "builtin:tiny-vlm": "vision_language"}


def config_modality(config: Any) -> Modality:
    """``vision_language`` for an HF config (object or ``config.json`` dict) with a vision sub-config."""
    if isinstance(config, dict):
        return "vision_language" if config.get("vision_config") is not None else "text"
    return "vision_language" if getattr(config, "vision_config", None) is not None else "text"


def detect_modality(model_path: str) -> Modality | None:
    """The modality of ``model_path`` (a built-in name or a local HF directory); None if it cannot be read.

    Reads ``config.json`` only (no weights, no transformers import), so validation can call it.
    """
    if model_path in BUILTIN_MODALITIES:
        return BUILTIN_MODALITIES[model_path]
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config_modality(raw) if isinstance(raw, dict) else None


def policy_auto_class(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if config_modality(config) == "vision_language" else AutoModelForCausalLM


def media_token_ids(config: Any) -> list[int]:
    """Placeholder ids of a vision-language config (image / video tokens) that a response must never hold.

    A sampled placeholder would be read as an image slot by the next forward, which then fails (more slots
    than images) or, worse, scatters image features into the response.
    """
    if config is None or config_modality(config) != "vision_language":
        return []
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    ids = {getattr(config, name, None) for name in names}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)
