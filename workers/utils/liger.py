"""liger-kernel's fused Triton kernels in the model builder (``model.use_liger``; CUDA only, GPU image).

``liger_kernel`` is imported here only, lazily: the CPU environment does not have it, and config validation
refuses ``model.use_liger=true`` with ``resources.device=cpu`` before any worker starts. Applied on the HF model
instance before LoRA and FSDP2 (liger replaces the RMSNorm / SwiGLU modules' forwards and the modelling
module's RoPE function, which works on a ``meta`` model too). Cross-entropy patches stay off: the actor computes
token log-probs from the logits itself (``workers.actor.forward``), it never calls the model with ``labels``.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

__all__ = ["apply_liger"]

# Kernels switched on: the ones that change the forward the trainer runs (see the module docstring).
LIGER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def apply_liger(model: nn.Module, *, device: torch.device | str) -> None:
    """Patches ``model`` (an HF ``PreTrainedModel``) in place with liger-kernel's fused kernels.

    Raises:
        ValueError: ``device`` is not CUDA, liger-kernel is not installed, or it has no kernels for the model type
            (each message names ``model.use_liger`` and the fix).
    """
    if torch.device(device).type != "cuda":
        raise ValueError(
            "model.use_liger=true: liger-kernel's kernels are Triton CUDA kernels and this worker runs on "
            f"{device}; set model.use_liger=false (or resources.device=cuda)."
        )
    try:
        transformers_api = importlib.import_module("liger_kernel.transformers")
        monkey_patch = importlib.import_module("liger_kernel.transformers.monkey_patch")
    except ImportError as exc:
        raise ValueError(
            "model.use_liger=true needs the liger-kernel package (installed in docker/worker.Dockerfile); install "
            "it or set model.use_liger=false."
        ) from exc
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {})
    if model_type not in supported:
        raise ValueError(
            f"model.use_liger=true: liger-kernel has no kernels for model_type={model_type!r} (it supports "
            f"{sorted(supported)}); set model.use_liger=false for this model."
        )
    # liger silently skips an unknown model type; the check above makes that an error instead.
    transformers_api._apply_liger_kernel_to_instance(model=model, **LIGER_KERNELS)
