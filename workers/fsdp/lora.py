"""LoRA through PEFT for the FSDP2 actor: wrap before FSDP2, disable the adapters for the reference policy.

Flow (``model.lora.rank > 0``)::

    model = load_hf_model(path, kind="causal_lm", meta=rank != 0)
    model = apply_lora(model, cfg.lora)       # PEFT adapters BEFORE FSDP2 (build_fsdp_model does this)
    apply_fsdp2(model, mesh, fsdp_cfg)        # AC -> fully_shard per decoder block -> root, as without LoRA
    optimizer = build_optimizer(model, ...)   # sees only requires_grad params: the adapters
    with adapters_disabled(model):            # the reference policy: the same weights, base only
        ref_log_probs = ...
    FSDPShardingManager(model, engine, bucket_bytes=...)  # rollout sync: sends W + scale * B @ A, HF names

FSDP2 and frozen parameters: a decoder block holds frozen base weights and trainable adapters in one
``fully_shard`` group. FSDP2 supports this (it all-gathers every parameter and reduce-scatters only the
gradients that exist; ``requires_grad`` of the unsharded parameter follows the sharded one at each
unshard), so no special grouping is needed; the root group (embeddings, final norm, LM head) is entirely
frozen under ``"all-linear"`` and takes part in forward only.

Names: PEFT prefixes every name with ``base_model.model.`` and moves an adapted layer's weight to
``<layer>.base_layer.weight``; its factors are ``<layer>.lora_A.<adapter>.weight`` (r, in) and
``<layer>.lora_B.<adapter>.weight`` (out, r). The weight sync (``workers.rollout.sharding_manager``) and the
offline export (``rlhf_ops.checkpoint.export``) merge the factors and map back to the HF names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel

from rlhf_ops.config.schema import LoraConfig

__all__ = ["adapters_disabled", "apply_lora"]


def apply_lora(model: PreTrainedModel, lora: LoraConfig) -> PeftModel:
    """Wraps a causal LM with PEFT LoRA adapters; every non-adapter parameter is frozen.

    Works on a real model and on a ``meta`` one (the adapters are then on ``meta`` too and receive rank 0's
    values from :func:`workers.fsdp.wrap.load_full_state_dict`). Adapters are created in the base weights'
    dtype (``autocast_adapter_dtype=False``): FSDP2 all-gathers a block's parameters as one flat buffer and
    needs one dtype per group. ``lora_A`` is drawn from the global torch RNG (Kaiming uniform), ``lora_B``
    is zero, so the wrapped model starts equal to the base model.

    Args:
        model: The HF causal LM (before ``apply_fsdp2``).
        lora: ``rank`` (> 0), ``alpha`` (scale = alpha / rank), ``dropout`` and ``target_modules``
            (module names such as ``["q_proj", "v_proj"]``, or ``"all-linear"``: every linear layer but the
            output head).

    Returns:
        A ``PeftModelForCausalLM`` around ``model``.

    Raises:
        ValueError: ``lora.rank`` is 0, or a target module is not in the model.
    """
    if lora.rank <= 0:
        raise ValueError("apply_lora needs model.lora.rank > 0; rank 0 means full fine-tuning (do not wrap).")
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    except ValueError as err:
        raise ValueError(
            f"model.lora.target_modules={lora.target_modules!r} does not match the model's layers ({err}); use "
            "'all-linear' or names of its linear layers such as ['q_proj', 'v_proj']."
        ) from err
    assert isinstance(peft_model, PeftModel)
    return peft_model


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """The base model inside the block: every LoRA layer computes ``base_layer(x)`` only.

    PEFT's ``disable_adapter()``; no weight is copied or changed. PEFT sets ``requires_grad=False`` on the
    adapters inside the block and back to True after it; FSDP2 copies the flag to the unsharded parameters
    at every all-gather, so training after the block sees trainable adapters again.

    Raises:
        ValueError: ``module`` is not a PEFT model.
    """
    if not isinstance(module, PeftModel):
        raise ValueError(
            f"adapters_disabled needs a PEFT model, got {type(module).__name__}; set model.lora.rank > 0."
        )
    with module.disable_adapter():
        yield
