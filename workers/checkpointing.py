"""Sharded save / load of one trained role (model + optimizer + LR scheduler) with DCP.

Each rank writes its own shards (``torch.distributed.checkpoint``), so a checkpoint written by N
ranks loads into M ranks (DCP reshards on load). The scheduler's state is a handful of numbers and
goes to JSON (written by rank 0): loading never unpickles anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

_SCHEDULER_FILE = "lr_scheduler.json"


def _scheduler_state(scheduler: LRScheduler | None) -> dict[str, object]:
    if scheduler is None:
        return {}
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if isinstance(v, int | float | str | list) and k != "lr_lambdas"}


def save_role_checkpoint(
    path: str, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None
) -> None:
    """Collective: every rank writes its shards of model and optimizer under ``path``."""
    model_sd, optim_sd = get_state_dict(module, optimizer if optimizer is not None else [])
    state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        (Path(path) / _SCHEDULER_FILE).write_text(json.dumps(_scheduler_state(scheduler)))
    dist.barrier()


def load_role_checkpoint(
    path: str, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None
) -> None:
    """Collective: loads (and reshards) what :func:`save_role_checkpoint` wrote."""
    optimizers = optimizer if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(module, optimizers)
    state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        module,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=StateDictOptions(strict=True),
    )
    sched_file = Path(path) / _SCHEDULER_FILE
    if scheduler is not None and sched_file.exists():
        saved = json.loads(sched_file.read_text())
        current = scheduler.state_dict()
        current.update(saved)
        scheduler.load_state_dict(current)
        # LambdaLR recomputes lr on the next step(); set the current lr for the restored epoch now.
        for group, lr in zip(optimizer.param_groups if optimizer else [], scheduler.get_last_lr(), strict=False):
            group["lr"] = lr
