"""Reading a role checkpoint without running pickled code, and the files of a role checkpoint folder.

A role checkpoint (``<ckpt>/<role>/``) is a DCP folder written by ``workers.checkpointing`` on the ranks, plus
``lr_scheduler.json`` and, for a PEFT model, ``lora_scaling.json``. This module is the offline side: the HF
export (:mod:`rlhf_ops.checkpoint.export`) reads the full weights here in one process with no process group,
and the workers load their shards through the same safe reader and planner.

Loading never runs arbitrary pickle: torch 2.13's ``FileSystemReader`` unpickles ``.metadata`` with
plain ``pickle.load`` and its default planner reads non-tensor values with
``torch.load(weights_only=False)``. :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`
replace both with an allow-listed unpickler and ``weights_only=True`` (tensor data is already read
with ``weights_only=True`` by torch).
"""

from __future__ import annotations

import enum
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

SCHEDULER_FILE = "lr_scheduler.json"
LORA_SCALING_FILE = "lora_scaling.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's config of the adapters (LoRA checkpoints)
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


def _enum_member(cls: Any, name: str) -> Any:
    """Stands in for ``getattr`` in a metadata pickle: only a member of an allow-listed enum.

    Python 3.11.0-3.11.4 pickles an enum member as ``getattr(EnumClass, "NAME")`` (later versions call the class
    with the value), so a checkpoint written by a Debian bookworm Python (3.11.2) holds ``builtins.getattr``.
    """
    if not (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__qualname__) in _METADATA_GLOBALS
    ):
        raise pickle.UnpicklingError(f"DCP .metadata calls getattr on {cls!r}, which is not an allowed enum")
    if name not in cls.__members__:
        raise pickle.UnpicklingError(f"DCP .metadata names {cls.__qualname__}.{name}, which is not a member")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file needs; anything else is refused before it runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
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
