"""Optimizer, learning-rate schedule, optimizer-state offload and the clipped optimizer step.

Everything here works on FSDP2 ``DTensor`` parameters as on plain tensors: AdamW steps each rank's
shard, ``clip_grad_norm_`` reduces the squared norms of the shards over the mesh (the returned norm is a
replicated ``DTensor``, read with ``full_tensor()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from rlhf_ops.config.schema import OptimConfig

__all__ = [
    "StepResult",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm",
    "clipped_optimizer_step",
    "load_optimizer_state",
    "offload_optimizer_state",
    "optimizer_offload",
    "restore_optimizer_kernel",
]


def _fused_supported(params: list[nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters: floating point, all on CPU or all on one CUDA
    device (DTensor shards included: FSDP2 documents fused AdamW on its sharded parameters)."""
    devices = {p.device.type for p in params}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


def build_optimizer(model: nn.Module, optim: OptimConfig) -> AdamW:
    """AdamW over the trainable parameters of ``model`` (call after ``apply_fsdp2``: it sees the shards).

    The fused kernel where it applies (one pass over param, gradient and both moments per tensor; what HF
    Trainer's default ``adamw_torch_fused`` uses): on CPU torch's default is the per-tensor loop, measured
    0.88 s per step over SmolLM2-135M's fp32 parameters on 2 threads against 0.35 s with ``foreach`` and
    0.098 s fused. The fused step differs from the loop by at most one fp32 ulp per element (its update is
    computed in a different order); the state (``exp_avg``, ``exp_avg_sq``, ``step``) has the same keys, so
    checkpoints load either way.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (requires_grad=False everywhere); nothing to optimise."
        )
    return AdamW(
        params,
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=_fused_supported(params) or None,
    )


def restore_optimizer_kernel(optimizer: Optimizer) -> None:
    """After loading a checkpoint: the kernel choice of this optimizer, not the saved one's.

    ``load_state_dict`` (and DCP's ``set_state_dict``) restore each param group's options as saved, ``fused``
    and ``foreach`` included, so a checkpoint of the per-tensor AdamW would switch the fused one back to the
    loop. The fused kernel also reads ``step`` on the parameters' device (the loop keeps it on the host).
    """
    fused = optimizer.defaults.get("fused")
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]
        if not fused:
            continue
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, Tensor) and step.device != param.device:
                optimizer.state[param]["step"] = step.to(param.device, dtype=torch.float32)


def _lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    warmup = optim.lr_warmup_steps
    floor = optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:  # linear from 0 (step 0) to 1 (step = warmup)
            return step / warmup
        if optim.lr_scheduler == "constant":
            return 1.0
        # Half a cosine from 1 (end of warm-up) to min_lr_ratio (total_steps), then flat (verl's formula).
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_lr_scheduler(optimizer: Optimizer, optim: OptimConfig, total_steps: int) -> LambdaLR:
    """Linear warm-up over ``lr_warmup_steps`` optimizer steps, then constant or cosine to ``min_lr_ratio * lr``.

    Step the scheduler once per optimizer step. The lr of step ``s`` (0-based) is ``lr * factor(s)`` with
    ``factor(s) = s / warmup`` during warm-up (so the first step runs at lr 0 when warm-up is on, as in verl),
    then 1 (constant) or ``min + (1 - min) * (1 + cos(pi * p)) / 2`` with ``p = (s - warmup) / (total - warmup)``.

    Raises:
        ValueError: ``total_steps`` < 1 or not above ``lr_warmup_steps`` with a cosine schedule.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 (optimizer steps of the run), got {total_steps}.")
    if optim.lr_scheduler == "cosine" and total_steps <= optim.lr_warmup_steps:
        raise ValueError(
            f"optim.lr_warmup_steps={optim.lr_warmup_steps} must be below the run's {total_steps} optimizer steps "
            "for a cosine schedule; lower the warm-up or use lr_scheduler='constant'."
        )
    return LambdaLR(optimizer, _lr_lambda(optim, total_steps))


def _move_optimizer_state(optimizer: Optimizer, device: torch.device | str, *, keep_step: bool = False) -> int:
    """Moves the state tensors to ``device``; returns how many moved. ``keep_step`` leaves Adam's ``step``."""
    target, moved = torch.device(device), 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if keep_step and key == "step":
                continue
            if isinstance(value, Tensor) and value.device != target:
                state[key] = value.to(target, non_blocking=True)
                moved += 1
    return moved


def offload_optimizer_state(optimizer: Optimizer) -> None:
    """Moves every optimizer state tensor (Adam moments, DTensor shards included) to the host."""
    moved = _move_optimizer_state(optimizer, "cpu")
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()  # non_blocking device-to-host copies must land before the host reads them


def load_optimizer_state(optimizer: Optimizer, device: torch.device | str) -> None:
    """Moves the optimizer state back to ``device`` before ``optimizer.step()``.

    Adam's scalar ``step`` stays where it is for the non-fused, non-capturable AdamW, which keeps it on the host
    on purpose (a device ``step`` would force a host sync per parameter to read it); the fused kernel reads it
    on the parameters' device, so there it moves too.
    """
    on_device_step = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    moved = _move_optimizer_state(optimizer, device, keep_step=not on_device_step)
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()


def _params_device(optimizer: Optimizer) -> torch.device:
    """Where the optimizer's parameters (their local shards) live: the device its state must be on."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return torch.device(param.device)
    return torch.device("cpu")


@contextmanager
def optimizer_offload(optimizer: Optimizer | None, *, enabled: bool) -> Iterator[None]:
    """Optimizer state on the host outside the block; on the parameters' device just before each step inside.

    Wrap one whole update (all its optimizer steps) in it. A step pre-hook loads the state before the
    block's first ``optimizer.step()`` (not at entry: forward and backward of the first mini-batch run
    without the state resident), later steps find it loaded; on exit the state goes back to the host.
    The target device is the parameters' (with ``CPUOffloadPolicy`` they live on the host, so the state
    never moves). A no-op when ``enabled`` is False or ``optimizer`` is None.
    """
    if not enabled or optimizer is None:
        yield
        return
    device = _params_device(optimizer)
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: load_optimizer_state(opt, device))
    try:
        yield
    finally:
        handle.remove()
        offload_optimizer_state(optimizer)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clips the global gradient norm to ``max_norm`` and returns the norm before clipping.

    Works on FSDP2 DTensor gradients: ``torch.nn.utils.clip_grad_norm_`` reduces the shard norms over the
    mesh (a collective: every rank must call it). A non-finite norm is returned as is; the caller skips the
    step. Gradients are then scaled by NaN, which does not matter as they are zeroed before the next use.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """Outcome of one :func:`clipped_optimizer_step`."""

    grad_norm: float
    """Global gradient norm before clipping (may be inf / nan)."""
    lr: float
    """Learning rate the step ran at (before the scheduler advanced)."""
    skipped: bool
    """True when the norm was not finite: no parameter changed, the scheduler did not advance."""


def clipped_optimizer_step(
    module: nn.Module, optimizer: Optimizer, lr_scheduler: LRScheduler | None, *, max_norm: float
) -> StepResult:
    """Grad clip -> ``optimizer.step()`` -> ``lr_scheduler.step()`` -> ``zero_grad``; skips non-finite norms."""
    grad_norm = clip_grad_norm(module.parameters(), max_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm=grad_norm, lr=lr, skipped=skipped)
