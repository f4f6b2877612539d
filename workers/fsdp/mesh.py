"""Device selection and the FSDP device mesh.

The FSDP mesh spans every rank of the role: 1-D ``("fsdp",)`` for plain FSDP (ZeRO-3 over all ranks), or
2-D ``("replicate", "shard")`` for HSDP (shard within a group of ``world / replicate`` ranks, replicate
across groups: gradients are reduce-scattered within a group, then all-reduced across groups).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["build_device_mesh", "get_device"]


def get_device(device: Literal["cpu", "cuda"] | str = "cuda") -> torch.device:
    """``cuda:<current>`` when ``device == "cuda"`` and CUDA is available, else ``cpu``."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_device_mesh(
    world_size: int, *, replicate_size: int = 1, sp_size: int = 1, device_type: str = "cpu"
) -> DeviceMesh:
    """The FSDP mesh of ``world_size`` ranks (``torch.distributed`` must be initialised).

    Args:
        world_size: Ranks of the role (the default process group's size).
        replicate_size: HSDP replica groups; 1 gives the 1-D ``("fsdp",)`` mesh, > 1 the 2-D
            ``("replicate", "shard")`` mesh of shape ``(replicate_size, world_size // replicate_size)``.
        sp_size: Ulysses sequence-parallel size; only 1 is implemented (verl shards parameters over all
            ranks, sp included, so the FSDP mesh would not change; the SP mesh will be a separate one).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).

    Raises:
        ValueError: ``world_size`` < 1, or not divisible by ``replicate_size``.
        NotImplementedError: ``sp_size`` > 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if replicate_size < 1 or world_size % replicate_size:
        raise ValueError(
            f"fsdp.hsdp_replicate_size={replicate_size} must be >= 1 and divide the world size {world_size}; "
            "set it to 1 (plain FSDP) or to a divisor such as the number of nodes."
        )
    if sp_size != 1:
        raise NotImplementedError(
            f"ulysses_sequence_parallel_size={sp_size}: Ulysses sequence parallelism is not implemented yet; set 1."
        )
    if replicate_size == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(
        device_type, (replicate_size, world_size // replicate_size), mesh_dim_names=("replicate", "shard")
    )
