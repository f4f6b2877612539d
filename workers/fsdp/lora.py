"""LoRA through PEFT for the FSDP2 actor: wrap, disable for the reference policy, merge for weight sync.

Flow (``model.lora.rank > 0``)::

    model = load_hf_model(path, kind="causal_lm", meta=rank != 0)
    model = apply_lora(model, cfg.lora)       # PEFT adapters BEFORE FSDP2 (build_fsdp_model does this)
    apply_fsdp2(model, mesh, fsdp_cfg)        # AC -> fully_shard per decoder block -> root, as without LoRA
    optimizer = build_optimizer(model, ...)   # sees only requires_grad params: the adapters
    with adapters_disabled(model):            # the reference policy: the same weights, base only
        ref_log_probs = ...
    for name, full in merged_state_dict_items(model):  # W + scale * B @ A under plain HF names
        engine_load(name, full)

FSDP2 and frozen parameters: a decoder block holds frozen base weights and trainable adapters in one
``fully_shard`` group. FSDP2 supports this (it all-gathers every parameter and reduce-scatters only the
gradients that exist; ``requires_grad`` of the unsharded parameter follows the sharded one at each
unshard), so no special grouping is needed; the root group (embeddings, final norm, LM head) is entirely
frozen under ``"all-linear"`` and takes part in forward only.

Names: PEFT prefixes every name with ``base_model.model.`` and moves an adapted layer's weight to
``<layer>.base_layer.weight``; its factors are ``<layer>.lora_A.<adapter>.weight`` (r, in) and
``<layer>.lora_B.<adapter>.weight`` (out, r). ``merged_state_dict_items`` maps back to the HF names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from rlhf_ops.config.schema import LoraConfig

__all__ = ["adapters_disabled", "apply_lora", "merged_state_dict_items"]

PEFT_PREFIX = "base_model.model."
_LORA_FACTOR = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")
_OTHER_ADAPTER = re.compile(r"\.(lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


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


def _full(param: Tensor) -> Tensor:
    """The unsharded tensor of ``param`` (all-gathered if it is a DTensor: a collective), detached."""
    tensor = param.detach()
    if not isinstance(tensor, DTensor):
        return tensor
    shard: DTensor = tensor
    mesh_device = shard.device_mesh.device_type
    if shard.device.type != mesh_device:  # CPUOffloadPolicy: host shards, accelerator mesh
        shard = shard.to(mesh_device)  # type: ignore[assignment]
    return shard.full_tensor()


def _hf_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return _MODULES_TO_SAVE.sub(".", name)


def _weight(linear: nn.Module) -> Tensor:
    weight = linear.weight
    assert isinstance(weight, Tensor)
    return weight


def _merge(layer: LoraLayer, weight: Tensor) -> Tensor:
    """``W + sum_a scaling_a * B_a @ A_a`` over the layer's active adapters, in fp32, cast back to W's dtype."""
    if layer.merged or layer.disable_adapters:  # in-place merged already, or base-only forward
        return weight
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = _full(_weight(layer.lora_A[adapter])).float()  # (r, in)
        b = _full(_weight(layer.lora_B[adapter])).float()  # (out, r)
        delta = (b @ a) * layer.scaling[adapter]  # (out, in)
        fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))  # Conv1D (GPT-2) stores (in, out)
        merged = merged + (delta.T if fan_in_fan_out else delta)
    return merged.to(weight.dtype)


def merged_state_dict_items(
    module: nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """``(hf_name, full tensor)`` for every parameter of the model, LoRA merged into the base weights.

    For the rollout weight sync (vLLM loads plain HF names). A collective when the model is FSDP2-sharded:
    every rank must iterate the whole iterator, in the same order (``named_parameters`` order, identical
    on every rank). One full tensor (plus, for an adapted layer, its two small factors) is gathered per
    item, so the caller bounds peak memory by how many items it keeps (bucket by bytes, load, drop).
    The adapters themselves are not yielded; PEFT's ``modules_to_save`` copies replace their originals.
    A model without PEFT yields its parameters unchanged (gathered). Buffers are not yielded.

    Args:
        module: The actor (PEFT or plain HF; FSDP2-wrapped or not).
        device: Move each full tensor there (default: where it was gathered).
        dtype: Cast each full tensor (default: the parameter's dtype; the merge itself runs in fp32).

    Yields:
        ``(name, tensor)``, e.g. ``("model.layers.0.self_attn.q_proj.weight", W + alpha / r * B @ A)``.

    Raises:
        ValueError: An adapter type other than LoRA on linear layers (embedding LoRA, DoRA).
    """
    layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    for name, param in module.named_parameters():
        if _OTHER_ADAPTER.search(name):
            raise ValueError(
                f"cannot merge PEFT parameter {name!r}: only LoRA on linear layers is supported (no embedding LoRA "
                "or DoRA); restrict model.lora.target_modules to linear layers."
            )
        if _LORA_FACTOR.search(name) or ".original_module." in name:
            continue  # factors are merged into their base weight; the trained modules_to_save copy is sent
        tensor = _full(param)
        layer = layers.get(name.removesuffix(".base_layer.weight")) if name.endswith(".base_layer.weight") else None
        if layer is not None:
            tensor = _merge(layer, tensor)
        if dtype is not None:
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        yield _hf_name(name), tensor
