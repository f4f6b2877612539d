"""FSDP2 building blocks: model loading, device mesh, wrapping, meta-init loading, optimizer and schedule."""

from __future__ import annotations

from workers.fsdp.mesh import build_device_mesh, get_device
from workers.fsdp.model import ModelKind, find_decoder_blocks, load_hf_config, load_hf_model
from workers.fsdp.optim import (
    StepResult,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm,
    clipped_optimizer_step,
    load_optimizer_state,
    offload_optimizer_state,
)
from workers.fsdp.wrap import apply_fsdp2, build_fsdp_model, load_full_state_dict

__all__ = [
    "ModelKind",
    "StepResult",
    "apply_fsdp2",
    "build_device_mesh",
    "build_fsdp_model",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm",
    "clipped_optimizer_step",
    "find_decoder_blocks",
    "get_device",
    "load_full_state_dict",
    "load_hf_config",
    "load_hf_model",
    "load_optimizer_state",
    "offload_optimizer_state",
]
