"""Device selection, the FSDP device mesh and the Ulysses (dp, sp) mesh.

The FSDP mesh spans every rank of the role: 1-D ``("fsdp",)`` for plain FSDP (ZeRO-3 over all ranks), or
2-D ``("replicate", "shard")`` for HSDP (shard within a group of ``world / replicate`` ranks, replicate
across groups: gradients are reduce-scattered within a group, then all-reduced across groups).

Ulysses sequence parallelism does not change it (verl: parameters are sharded over all ranks, SP ranks
included); its groups come from a separate ``("dp", "sp")`` mesh (:func:`build_sp_mesh`) whose SP groups
are consecutive ranks, as the single controller's dispatch assumes.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["build_device_mesh", "build_sp_mesh", "get_device", "sp_process_groups"]


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
        sp_size: Must be 1: the FSDP mesh is the same for every Ulysses size (parameters are sharded over
            all ranks, sp included); build the SP groups with :func:`build_sp_mesh`.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).

    Raises:
        ValueError: ``world_size`` < 1, or not divisible by ``replicate_size``.
        NotImplementedError: ``sp_size`` > 1 (this function builds no SP mesh).
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
            f"build_device_mesh(sp_size={sp_size}): the FSDP mesh does not depend on Ulysses sequence parallelism; "
            "call it without sp_size and build the (dp, sp) groups with build_sp_mesh(world_size, sp_size=...)."
        )
    if replicate_size == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(
        device_type, (replicate_size, world_size // replicate_size), mesh_dim_names=("replicate", "shard")
    )


def build_sp_mesh(world_size: int, *, sp_size: int, device_type: str = "cpu") -> DeviceMesh:
    """The ``("dp", "sp")`` mesh of shape ``(world_size // sp_size, sp_size)`` (collective, every rank).

    Rank ``r`` is in SP group ``r // sp_size`` at position ``r % sp_size`` (consecutive ranks share a sequence,
    matching ``Worker.set_sequence_parallel_size``); ``mesh["dp"]`` holds the ranks with the same SP position.

    Raises:
        ValueError: ``sp_size`` < 1 or not a divisor of ``world_size``.
    """
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp_size} must be >= 1 and divide the world size {world_size}; "
            "set a divisor of the number of ranks."
        )
    return init_device_mesh(device_type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


def sp_process_groups(
    world_size: int, *, sp_size: int, device_type: str = "cpu"
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(dp_group, sp_group)`` for ``sp_size`` > 1 (from :func:`build_sp_mesh`); ``(None, None)`` for 1.

    None keeps the actor / critic defaults (the default group is the dp group, no SP), so the ``sp_size == 1``
    path creates no group at all.
    """
    if sp_size == 1:
        return None, None
    mesh = build_sp_mesh(world_size, sp_size=sp_size, device_type=device_type)
    return mesh["dp"].get_group(), mesh["sp"].get_group()
