"""FSDP2 wrapping in one function (torchtitan's order) and the meta-init + rank-0 broadcast load.

Order inside :func:`apply_fsdp2`, fixed: activation checkpointing (HF non-reentrant checkpointing of each
decoder block) -> ``fully_shard`` on each unit of the wrap policy (by default each decoder block: one
all-gather / reduce-scatter group per block; or modules by class name, or by parameter count) -> ``fully_shard``
on the root (embeddings, final norm, head) -> explicit forward / backward prefetch between the units.
Parameters become ``DTensor`` shards on ``mesh``; the module keeps its HF class and state-dict keys
(``FSDPModule`` is mixed into the class).

Loading a model too large for every rank (verl's flow)::

    model = load_hf_model(path, kind="causal_lm", meta=rank != 0)   # real weights on rank 0 only
    full = model.state_dict() if rank == 0 else None
    model = apply_fsdp2(model, mesh, cfg)
    load_full_state_dict(model, full, device=device, cpu_offload=cfg.param_offload)

:func:`build_fsdp_model` does exactly this.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from rlhf_ops.config.precision import RolePrecision, mechanism_for
from rlhf_ops.config.schema import FSDPConfig, FSDPWrapPolicyConfig, LoraConfig
from workers.fsdp.lora import apply_lora
from workers.fsdp.model import ModelKind, find_decoder_blocks, load_hf_model
from workers.fsdp.precision import enable_cpu_autocast, mixed_precision_policy

__all__ = ["apply_fsdp2", "build_fsdp_model", "load_full_state_dict", "select_wrap_modules"]

_LOG = logging.getLogger(__name__)


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


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of parameters reachable under more than one name (tied embeddings / LM head)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def _size_based_modules(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """torch's ``size_based_auto_wrap_policy`` rule, bottom-up: a (non-root) module is wrapped when its
    parameters not already in a wrapped descendant number at least ``min_num_params``. As torch's policy,
    containers without a forward (``ModuleList`` / ``ModuleDict``) are never units (FSDP2's hooks run on forward).
    A module holding a tied parameter is never a unit either (one tensor cannot be sharded in two units)."""
    tied = _tied_parameter_ids(model)
    wrapped: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        # Returns the parameters of ``module`` not covered by a wrapped descendant.
        uncovered = sum(visit(child) for child in module.children())
        uncovered += sum(p.numel() for p in module.parameters(recurse=False))
        has_tied = any(id(p) in tied for p in module.parameters())
        container = isinstance(module, nn.ModuleList | nn.ModuleDict)
        if module is not model and uncovered >= min_num_params and not has_tied and not container:
            wrapped.append(module)
            return 0
        return uncovered

    visit(model)
    return wrapped  # post-order: children before parents, as nested fully_shard needs


def select_wrap_modules(model: nn.Module, policy: FSDPWrapPolicyConfig) -> list[nn.Module]:
    """The modules that get their own ``fully_shard`` (before the root), children before parents.

    By parameter count (``policy.min_num_params > 0``), by class name (``transformer_layer_cls_to_wrap``), or by
    default the decoder blocks (:func:`workers.fsdp.model.find_decoder_blocks`).

    Raises:
        ValueError: No module of the named classes exists in the model (the message lists the classes it has).
    """
    if policy.min_num_params > 0:
        return _size_based_modules(model, policy.min_num_params)
    if policy.transformer_layer_cls_to_wrap is not None:
        names = set(policy.transformer_layer_cls_to_wrap)
        modules = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not modules:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"fsdp.wrap_policy.transformer_layer_cls_to_wrap={sorted(names)} matches no module of "
                f"{type(model).__name__}; its classes are {present}: name one of them (e.g. the decoder layer)."
            )
        return modules[::-1]  # pre-order reversed: nested matches are sharded before their parents
    return find_decoder_blocks(model)


def _set_prefetch(units: list[nn.Module], *, forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetch between consecutive units (in forward order); 0 / 1 keep FSDP2's defaults."""
    blocks = [u for u in units if isinstance(u, FSDPModule)]
    for i, block in enumerate(blocks):
        if forward > 0 and i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward])  # type: ignore[arg-type]
        if backward > 1 and i > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward) : i][::-1])  # type: ignore[arg-type]


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
            ``cfg.wrap_policy`` picks the units (:func:`select_wrap_modules`); ``forward_prefetch`` /
            ``backward_prefetch`` set FSDP2's explicit prefetch between consecutive units (nested units from a
            size policy prefetch in module order).

    Returns:
        ``model`` itself, now an ``FSDPModule``; unchanged (plain parameters) with ``cfg.single_rank_plain`` on a
        one-rank mesh, unless the precision's mechanism is ``"fsdp2"``.

    Raises:
        ValueError: ``activation_checkpointing`` on a model that does not support HF gradient checkpointing,
            a model whose decoder blocks cannot be found, or a class list that matches no module.
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
    if cfg.single_rank_plain and mesh.size() == 1 and precision.mechanism != "fsdp2":
        # One rank: FSDP2 would shard nothing, only copy every parameter (all-gathers) and every gradient
        # (reduce-scatters). Kept under "fsdp2" precision, whose bf16 cast rides on those all-gathers.
        if precision.mechanism == "autocast":
            enable_cpu_autocast(model, _dtype(precision.compute))
        _LOG.info("fsdp.single_rank_plain: %s keeps plain parameters on its one rank", type(model).__name__)
        return model
    mp_policy = mixed_precision_policy(precision)
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.param_offload and mesh.device_type != "cpu":
        offload = CPUOffloadPolicy(pin_memory=True)
    reshard = cfg.reshard_after_forward
    units = select_wrap_modules(model, cfg.wrap_policy)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    if precision.mechanism == "autocast":
        enable_cpu_autocast(model, _dtype(precision.compute))
    _set_prefetch(_outermost_in_order(model, units), forward=cfg.forward_prefetch, backward=cfg.backward_prefetch)
    return model


def _outermost_in_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Units not nested in another unit, in ``model.modules()`` order (the execution order of a decoder stack)."""
    unit_ids = {id(u) for u in units}
    inner = {id(m) for u in units for m in u.modules() if m is not u and id(m) in unit_ids}
    return [m for m in model.modules() if id(m) in unit_ids and id(m) not in inner]


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
    use_liger: bool = False,
) -> nn.Module:
    """Rank 0 loads ``path``, the others build on ``meta``; FSDP2 is applied and rank 0's weights broadcast.

    Collective over the default process group. See :func:`workers.fsdp.model.load_hf_model` for ``kind``.
    With ``lora`` of rank > 0 the model is wrapped with PEFT LoRA adapters before FSDP2
    (:func:`workers.fsdp.lora.apply_lora`): only the adapters train, and rank 0's adapter init is broadcast
    with the base weights. ``precision`` (see :func:`apply_fsdp2`) overrides ``dtype`` with ``precision.master``.
    ``use_liger`` patches the HF model with liger-kernel's fused kernels first
    (:func:`workers.utils.liger.apply_liger`, CUDA only).
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
    if use_liger:
        from workers.utils.liger import apply_liger

        apply_liger(hf_model, device=device)
    model: nn.Module = apply_lora(hf_model, lora) if lora is not None and lora.rank > 0 else hf_model
    # The dict holds the original tensors: fully_shard copies them into new shards, these stay valid.
    full = model.state_dict() if rank == 0 else None
    apply_fsdp2(model, mesh, cfg, precision=precision)
    offload = cfg.param_offload and mesh.device_type != "cpu"
    load_full_state_dict(model, full, device=device, cpu_offload=offload)
    return model
