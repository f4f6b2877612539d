"""FSDP2 wrapping in one function (torchtitan's order) and the meta-init + rank-0 broadcast load.

Order inside :func:`apply_fsdp2`, fixed: activation checkpointing (HF non-reentrant checkpointing of each
decoder block) -> ``fully_shard`` on each decoder block (one all-gather / reduce-scatter group per block)
-> ``fully_shard`` on the root (embeddings, final norm, head). Parameters become ``DTensor`` shards on
``mesh``; the module keeps its HF class and state-dict keys (``FSDPModule`` is mixed into the class).

Loading a model too large for every rank (verl's flow)::

    model = load_hf_model(path, kind="causal_lm", meta=rank != 0)   # real weights on rank 0 only
    full = model.state_dict() if rank == 0 else None
    model = apply_fsdp2(model, mesh, cfg)
    load_full_state_dict(model, full, device=device, cpu_offload=cfg.param_offload)

:func:`build_fsdp_model` does exactly this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from rlhf_ops.config.precision import RolePrecision, mechanism_for
from rlhf_ops.config.schema import FSDPConfig, LoraConfig
from workers.fsdp.lora import apply_lora
from workers.fsdp.model import ModelKind, find_decoder_blocks, load_hf_model
from workers.fsdp.precision import enable_cpu_autocast, mixed_precision_policy

__all__ = ["apply_fsdp2", "build_fsdp_model", "load_full_state_dict"]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _model_precision(model: nn.Module, cfg: FSDPConfig, device_type: str) -> RolePrecision:
    """Precision when the caller resolved none: master = the model's own dtype, compute from ``cfg``."""
    master = str(next(model.parameters()).dtype).removeprefix("torch.")
    compute = cfg.mixed_precision.param_dtype or master
    return RolePrecision(
        master=master,  # type: ignore[arg-type]
        compute=compute,  # type: ignore[arg-type]
        reduce=cfg.mixed_precision.reduce_dtype,
        mechanism=mechanism_for(master, compute, device=device_type),  # type: ignore[arg-type]
    )


def apply_fsdp2(
    model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig, *, precision: RolePrecision | None = None
) -> nn.Module:
    """Applies activation checkpointing and FSDP2 to an HF model, in place, in a fixed order.

    Args:
        model: HF model, on the host or on ``meta`` (then load weights with :func:`load_full_state_dict`).
        mesh: From :func:`workers.fsdp.mesh.build_device_mesh` (1-D FSDP or 2-D HSDP).
        cfg: The role's FSDP section. ``param_offload`` becomes ``CPUOffloadPolicy`` (sharded params and grads on the
            host, the optimizer steps on the host); it needs an accelerator mesh and is ignored on a CPU
            mesh, where everything is on the host already. ``reshard_after_forward`` applies to every
            block and to the root (explicit for the root too: a root left unsharded after forward would
            expose plain tensors, not DTensors, to state-dict and weight-sync code).
        precision: From :func:`rlhf_ops.config.precision.resolve_precision`; the model must already be in
            ``precision.master``. ``"fsdp2"`` becomes a ``MixedPrecisionPolicy`` (params gathered in the compute
            dtype, gradients reduced in ``precision.reduce``), ``"autocast"`` wraps the forward in CPU autocast
            (:mod:`workers.fsdp.precision`). None: master = the model's dtype, compute = ``cfg.mixed_precision``.

    Returns:
        ``model`` itself, now an ``FSDPModule``.

    Raises:
        ValueError: ``activation_checkpointing`` on a model that does not support HF gradient checkpointing,
            or a model whose decoder blocks cannot be found.
    """
    if cfg.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"fsdp.activation_checkpointing=True but {type(model).__name__} does not support HF gradient "
                "checkpointing; set fsdp.activation_checkpointing=False."
            )
        # Non-reentrant checkpointing: works with FSDP2 hooks and with inputs that need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    precision = precision or _model_precision(model, cfg, mesh.device_type)
    mp_policy = mixed_precision_policy(precision)
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.param_offload and mesh.device_type != "cpu":
        offload = CPUOffloadPolicy(pin_memory=True)
    reshard = cfg.reshard_after_forward
    for block in find_decoder_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    if precision.mechanism == "autocast":
        enable_cpu_autocast(model, _dtype(precision.compute))
    return model


def _has_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.is_meta for t in tensors)


def load_full_state_dict(
    model: nn.Module,
    full_state_dict: Mapping[str, Tensor] | None,
    *,
    device: torch.device | str,
    cpu_offload: bool = False,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Loads rank 0's full state dict into an FSDP2 model on every rank (collective).

    Non-zero ranks' models may be on ``meta``: they are materialised with ``to_empty`` (uninitialised
    memory), then filled by ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True))``, which broadcasts one tensor at a time and keeps each rank's shard.
    Buffers that are not in the state dict (non-persistent ones such as the rotary ``inv_freq``) are then
    broadcast from rank 0, whose model must therefore be real (``meta=False``).

    Args:
        model: After :func:`apply_fsdp2`.
        full_state_dict: Rank 0: the full (unsharded) state dict, keys as ``model.state_dict()``; other
            ranks: None.
        device: The compute device (``cuda:<i>`` or ``cpu``); shards and buffers live there.
        cpu_offload: The model uses ``CPUOffloadPolicy``: shards are loaded on ``device``, then moved to the
            host; buffers stay on ``device``.
        group: Process group of the broadcast (default: the default group, whose rank 0 is the source).

    Raises:
        ValueError: Rank 0 passed no state dict, or rank 0's model has meta tensors.
    """
    rank = dist.get_rank(group)
    if rank == 0 and (full_state_dict is None or _has_meta(model)):
        raise ValueError(
            "rank 0 must hold the real model and pass its full state dict: build it with "
            "load_hf_model(..., meta=False) and pass model.state_dict() taken before apply_fsdp2."
        )
    # Materialise on the compute device even with offload (verl's order): NCCL broadcasts device tensors only.
    if _has_meta(model):
        model.to_empty(device=device)
    else:
        model.to(device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload)
    set_model_state_dict(model, dict(full_state_dict or {}), options=options)
    if cpu_offload:
        model.to("cpu")  # CPUOffloadPolicy keeps the sharded params on the host
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for buf in model.buffers():
        # Buffers are plain tensors under FSDP2 (not sharded, not offloaded); every rank takes rank 0's values.
        buf.data = buf.data.to(device)
        dist.broadcast(buf, src=src, group=group)


def build_fsdp_model(
    path: str | os.PathLike[str],
    *,
    kind: ModelKind,
    mesh: DeviceMesh,
    cfg: FSDPConfig,
    device: torch.device | str,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    lora: LoraConfig | None = None,
    precision: RolePrecision | None = None,
) -> nn.Module:
    """Rank 0 loads ``path``, the others build on ``meta``; FSDP2 is applied and rank 0's weights broadcast.

    Collective over the default process group. See :func:`workers.fsdp.model.load_hf_model` for ``kind``.
    With ``lora`` of rank > 0 the model is wrapped with PEFT LoRA adapters before FSDP2
    (:func:`workers.fsdp.lora.apply_lora`): only the adapters train, and rank 0's adapter init is broadcast
    with the base weights. ``precision`` (see :func:`apply_fsdp2`) overrides ``dtype`` with ``precision.master``.
    """
    rank = dist.get_rank()
    if precision is not None:
        dtype = precision.master
    hf_model = load_hf_model(
        path,
        kind=kind,
        dtype=dtype,
        attn_implementation=attn_implementation,
        meta=rank != 0,
        trust_remote_code=trust_remote_code,
    )
    model: nn.Module = apply_lora(hf_model, lora) if lora is not None and lora.rank > 0 else hf_model
    # The dict holds the original tensors: fully_shard copies them into new shards, these stay valid.
    full = model.state_dict() if rank == 0 else None
    apply_fsdp2(model, mesh, cfg, precision=precision)
    offload = cfg.param_offload and mesh.device_type != "cpu"
    load_full_state_dict(model, full, device=device, cpu_offload=offload)
    return model
