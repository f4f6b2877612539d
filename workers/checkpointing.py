"""Sharded save / load of one trained role (model + optimizer + LR scheduler) with DCP.

Each rank writes its own shards (``torch.distributed.checkpoint``), so a checkpoint written by N
ranks loads into M ranks (DCP reshards on load). The scheduler's state is a handful of numbers and
goes to JSON (written by rank 0), as do the LoRA scalings of a PEFT model (``lora_scaling.json``,
used by the HF export to merge the adapters). The file names and the safe reader (no pickled code
runs on load) are the library's: :mod:`rlhf_ops.checkpoint.dcp_reader`.

Without a shared filesystem (``trainer.shared_checkpoint_root=false``) each rank saves into its own node's
folder and uploads what it wrote (:func:`save_role_to_store`), and loads from its node's copy of the
remote checkpoint (:func:`fetch_role_dir`): :mod:`rlhf_ops.checkpoint.node_local`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_ops.checkpoint.dcp_reader import (
    ADAPTER_CONFIG_FILE,
    LORA_SCALING_FILE,
    MODEL_KEY,
    SCHEDULER_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
)
from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload, fetch_to_node, upload_rank_files
from workers.adapter_state import restrict_to_checkpoint, select_adapter_entries, write_adapter_config
from workers.fsdp.optim import restore_optimizer_kernel

DCP_METADATA_FILE = ".metadata"  # written by the coordinator (rank 0) once every rank's shards are written


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer that records the files this rank wrote (its ``__<rank>_<i>.distcp`` shards)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: set[str] = set()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        future = super().write_data(plan, planner)
        results: list[WriteResult] = future.wait()  # FileSystemWriter writes synchronously: already done
        self.written.update(result.storage_data.relative_path for result in results)
        return future


def _scheduler_state(scheduler: LRScheduler | None) -> dict[str, object]:
    if scheduler is None:
        return {}
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if isinstance(v, int | float | str | list) and k != "lr_lambdas"}


def lora_scalings(module: nn.Module) -> dict[str, dict[str, float]]:
    """``{LoRA layer name: {active adapter: scaling}}`` of a PEFT model; empty for a plain model."""
    found: dict[str, dict[str, float]] = {}
    for name, layer in module.named_modules():
        scaling = getattr(layer, "scaling", None)
        if isinstance(scaling, dict) and hasattr(layer, "lora_A"):
            active = getattr(layer, "active_adapters", list(scaling))
            found[name] = {a: float(scaling[a]) for a in active if a in scaling}
    return found


def save_role_checkpoint(
    path: str,
    module: nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    *,
    adapter_only: bool = False,
) -> list[str]:
    """Collective: every rank writes its shards of model and optimizer under ``path``.

    With ``adapter_only`` (``model.lora.save_adapter_only``) the model entries are the trainable adapters only
    (:mod:`workers.adapter_state`); the optimizer holds state for those alone anyway.

    Returns:
        The names (relative to ``path``) of the files this rank wrote: its shards, and on rank 0 also DCP's
        ``.metadata``, the scheduler's JSON and the LoRA scalings.
    """
    model_sd, optim_sd = get_state_dict(module, optimizer if optimizer is not None else [])
    if adapter_only:
        model_sd = select_adapter_entries(model_sd, module)
    state = {MODEL_KEY: model_sd} if optimizer is None else {MODEL_KEY: model_sd, "optim": optim_sd}
    writer = _RecordingWriter(path)
    dcp.save(state, storage_writer=writer)
    written = set(writer.written)
    if dist.get_rank() == 0:
        (Path(path) / SCHEDULER_FILE).write_text(json.dumps(_scheduler_state(scheduler)))
        written |= {DCP_METADATA_FILE, SCHEDULER_FILE}
        scalings = lora_scalings(module)
        if scalings:
            (Path(path) / LORA_SCALING_FILE).write_text(json.dumps(scalings, indent=1, sort_keys=True))
            written.add(LORA_SCALING_FILE)
        if write_adapter_config(module, Path(path)):
            written.add(ADAPTER_CONFIG_FILE)
    dist.barrier()
    return sorted(written)


def save_role_to_store(
    ckpt: NodeCheckpoint,
    role: str,
    module: nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    *,
    adapter_only: bool = False,
) -> RankUpload:
    """Collective: every rank saves under ``<its node folder>/<role>``, then uploads and deletes its own files.

    The upload is this rank's alone (after the save's barrier): the driver commits the manifest once every rank
    returned.
    """
    rank = dist.get_rank()
    files = save_role_checkpoint(
        str(ckpt.local_dir(rank) / role), module, optimizer, scheduler, adapter_only=adapter_only
    )
    return upload_rank_files(ckpt, rank=rank, role=role, files=files)


def fetch_role_dir(ckpt: NodeCheckpoint, role: str) -> str:
    """This rank's node copy of the remote checkpoint's ``<role>`` folder (fetched once per node folder)."""
    return str(fetch_to_node(ckpt, rank=dist.get_rank()) / role)


def load_role_checkpoint(
    path: str, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None
) -> None:
    """Collective: loads (and reshards) what :func:`save_role_checkpoint` wrote.

    An adapter-only checkpoint loads the adapters (and their optimizer state) and leaves the base weights as
    the module was built (from ``model.path``); which kind ``path`` holds is read from the checkpoint.
    """
    optimizers: Optimizer | list[Optimizer] = optimizer if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(module, optimizers)
    model_sd, adapter_only = restrict_to_checkpoint(model_sd, module, path)
    state: dict[str, Any] = {MODEL_KEY: model_sd} if optimizer is None else {MODEL_KEY: model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(
        module,
        optimizers,
        model_state_dict=state[MODEL_KEY],
        optim_state_dict=state.get("optim", {}),
        options=StateDictOptions(strict=not adapter_only),
    )
    if optimizer is not None:
        restore_optimizer_kernel(optimizer)
    sched_file = Path(path) / SCHEDULER_FILE
    if scheduler is not None and sched_file.exists():
        saved = json.loads(sched_file.read_text())
        current = scheduler.state_dict()
        current.update(saved)
        scheduler.load_state_dict(current)
        # LambdaLR recomputes lr on the next step(); set the current lr for the restored epoch now.
        for group, lr in zip(optimizer.param_groups if optimizer else [], scheduler.get_last_lr(), strict=False):
            group["lr"] = lr


def gather_full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """Collective: the module's full weights on CPU on rank 0 (``{}`` on the other ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(module, options=options)
    return {name: value for name, value in full.items() if isinstance(value, Tensor)}
