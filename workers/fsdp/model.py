"""Build HF models for the FSDP roles: policy / reference (causal LM), critic (value head), reward model.

Meta-device loading: ``meta=True`` builds the architecture from the config on the ``meta`` device (no
memory, no weight reads). The FSDP flow is verl's: rank 0 loads the real weights (``meta=False``) on the
host, every other rank builds on ``meta``; after ``apply_fsdp2`` the ranks call
:func:`workers.fsdp.wrap.load_full_state_dict`, which broadcasts rank 0's tensors one at a time, so a 7B
model is materialised in full on rank 0's host only, never on every rank.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from rlhf_ops.models.modality import policy_auto_class

ModelKind = Literal["causal_lm", "value", "sequence_classification"]

__all__ = ["ModelKind", "find_decoder_blocks", "load_hf_model", "load_hf_config"]

_AUTO_CLASSES = {
    "causal_lm": AutoModelForCausalLM,
    "value": AutoModelForTokenClassification,
    "sequence_classification": AutoModelForSequenceClassification,
}


def load_hf_config(
    path: str | os.PathLike[str], *, kind: ModelKind, trust_remote_code: bool = False
) -> PretrainedConfig:
    """The HF config of ``path`` adjusted for ``kind``.

    ``value`` and ``sequence_classification`` get ``num_labels=1``; ``value`` also gets
    ``classifier_dropout=0.0`` (the generic token-classification head defaults to dropout 0.1, which would
    make two forwards of the same batch disagree and break ``values == vpreds`` at the first PPO step).
    """
    if kind not in _AUTO_CLASSES:
        raise ValueError(f"kind={kind!r} is unknown; use one of {sorted(_AUTO_CLASSES)}.")
    config = AutoConfig.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code)
    if kind in ("value", "sequence_classification"):
        config.num_labels = 1
    if kind == "value":
        config.classifier_dropout = 0.0
    return config


def load_hf_model(
    path: str | os.PathLike[str],
    *,
    kind: ModelKind,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    meta: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Loads (or, with ``meta``, only builds) one HF model for an FSDP role.

    Kinds:
        ``causal_lm``: ``AutoModelForCausalLM`` (policy and reference); logits (B, T, V). A vision-language
            config (``vision_config`` set, e.g. LLaVA) loads with ``AutoModelForImageTextToText`` instead
            (:func:`rlhf_ops.models.modality.policy_auto_class`); its forward also takes ``pixel_values``.
        ``value``: ``AutoModelForTokenClassification`` with ``num_labels=1`` built from the causal-LM config
            (verl's critic): the decoder stack of the checkpoint plus a per-token value head
            ``score = Linear(hidden, 1)``; logits (B, T, 1). Loading a causal-LM directory leaves ``score``
            missing from the checkpoint, so HF initialises it with ``_init_weights``: weight ~
            N(0, ``config.initializer_range``) (0.02 for Llama), bias = 0, drawn from the global torch RNG
            (seed it for reproducible critics; only rank 0's draw is used, the others receive it by
            broadcast). The causal-LM ``lm_head`` is dropped.
        ``sequence_classification``: ``AutoModelForSequenceClassification`` with ``num_labels=1`` (reward
            model); logits (B, 1) scored at the last non-pad token.

    Args:
        path: Local HF model directory.
        kind: One of the kinds above.
        dtype: Weight dtype (``torch.float32`` master weights for trained roles).
        attn_implementation: ``"eager"``, ``"sdpa"`` or ``"flash_attention_2"``.
        meta: Build on the ``meta`` device from the config only (no weights read); load weights later
            with :func:`workers.fsdp.wrap.load_full_state_dict`.
        trust_remote_code: Allow custom modelling code from ``path``.

    Returns:
        The model (``use_cache`` disabled: training never needs the KV cache).

    Raises:
        ValueError: Unknown ``kind``.
    """
    config = load_hf_config(path, kind=kind, trust_remote_code=trust_remote_code)
    config.use_cache = False
    # A vision-language config (one with a vision_config) builds with AutoModelForImageTextToText.
    auto_cls = policy_auto_class(config) if kind == "causal_lm" else _AUTO_CLASSES[kind]
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    common = {"dtype": torch_dtype, "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    if meta:
        with torch.device("meta"):
            model = auto_cls.from_config(config, **common)
    else:
        model = auto_cls.from_pretrained(os.fspath(path), config=config, **common)
    return model


def find_decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of an HF model: modules whose class is in ``_no_split_modules``.

    Falls back to ``model.model.layers`` (Llama / Qwen / Mistral layout) when the model declares no
    ``_no_split_modules``.

    Raises:
        ValueError: No block found (the model is neither a declared HF transformer nor has ``model.layers``).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__}: it declares no _no_split_modules and has no "
        "model.layers; shard it with fully_shard by hand or add _no_split_modules to its class."
    )
