"""Sharded save / load of one trained role (model + optimizer + LR scheduler) with DCP.

Each rank writes its own shards (``torch.distributed.checkpoint``), so a checkpoint written by N
ranks loads into M ranks (DCP reshards on load). The scheduler's state is a handful of numbers and
goes to JSON (written by rank 0), as do the LoRA scalings of a PEFT model (``lora_scaling.json``,
used by the HF export to merge the adapters).

Loading never runs arbitrary pickle: torch 2.13's ``FileSystemReader`` unpickles ``.metadata`` with
plain ``pickle.load`` and its default planner reads non-tensor values with
``torch.load(weights_only=False)``. :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`
replace both with an allow-listed unpickler and ``weights_only=True`` (tensor data is already read
with ``weights_only=True`` by torch).
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

SCHEDULER_FILE = "lr_scheduler.json"
LORA_SCALING_FILE = "lora_scaling.json"
MODEL_KEY = "model"  # top-level key of the model's weights in a role checkpoint ("optim" holds the optimizer)

# Everything torch 2.13 puts in a DCP ``.metadata`` pickle (dataclasses, torch.Size, dtypes, a path).
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file needs; anything else is refused before it runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP .metadata references {module}.{name}, which is not allowed (a tampered or foreign checkpoint?)"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with an allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values (optimizer hyper-parameters) with ``weights_only``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Same as the parent, with weights_only=True: plain numbers, strings, tuples, lists and None load.
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
    path: str, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None
) -> None:
    """Collective: every rank writes its shards of model and optimizer under ``path``."""
    model_sd, optim_sd = get_state_dict(module, optimizer if optimizer is not None else [])
    state = {MODEL_KEY: model_sd} if optimizer is None else {MODEL_KEY: model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        (Path(path) / SCHEDULER_FILE).write_text(json.dumps(_scheduler_state(scheduler)))
        scalings = lora_scalings(module)
        if scalings:
            (Path(path) / LORA_SCALING_FILE).write_text(json.dumps(scalings, indent=1, sort_keys=True))
    dist.barrier()


def load_role_checkpoint(
    path: str, module: nn.Module, optimizer: Optimizer | None, scheduler: LRScheduler | None
) -> None:
    """Collective: loads (and reshards) what :func:`save_role_checkpoint` wrote."""
    optimizers: Optimizer | list[Optimizer] = optimizer if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(module, optimizers)
    state: dict[str, Any] = {MODEL_KEY: model_sd} if optimizer is None else {MODEL_KEY: model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(
        module,
        optimizers,
        model_state_dict=state[MODEL_KEY],
        optim_state_dict=state.get("optim", {}),
        options=StateDictOptions(strict=True),
    )
    sched_file = Path(path) / SCHEDULER_FILE
    if scheduler is not None and sched_file.exists():
        saved = json.loads(sched_file.read_text())
        current = scheduler.state_dict()
        current.update(saved)
        scheduler.load_state_dict(current)
        # LambdaLR recomputes lr on the next step(); set the current lr for the restored epoch now.
        for group, lr in zip(optimizer.param_groups if optimizer else [], scheduler.get_last_lr(), strict=False):
            group["lr"] = lr


def read_model_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The full (unsharded) model weights of a role checkpoint, read in this process, no process group.

    Only the ``model`` entries are read (the optimizer state, about twice the model, is skipped), on CPU,
    in the dtype they were saved in. Loading is safe (:class:`SafeFileSystemReader`, ``weights_only``).

    Returns:
        ``{FQN: tensor}`` with the names of the trained module (``base_model.model.…`` for a PEFT model).
    """
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    weights: dict[str, Tensor] = {}
    for flat_key, entry in metadata.state_dict_metadata.items():
        keys = metadata.planner_data.get(flat_key, ())
        if len(keys) != 2 or keys[0] != MODEL_KEY:
            continue  # optimizer state, or a nested entry a model state dict never has
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{path}: model entry {keys[1]!r} is not a tensor; not a role checkpoint of this project")
        weights[str(keys[1])] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not weights:
        raise ValueError(f"{path}: the checkpoint holds no '{MODEL_KEY}' weights; point at <ckpt>/<role>")
    state: dict[str, Any] = {MODEL_KEY: weights}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    return dict(state[MODEL_KEY])


def gather_full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """Collective: the module's full weights on CPU on rank 0 (``{}`` on the other ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(module, options=options)
    return {name: value for name, value in full.items() if isinstance(value, Tensor)}
