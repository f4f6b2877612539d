"""Pure dispatch logic for ``Dispatch.DP_COMPUTE_PROTO``: split a batch across ranks, gather it back.

No Ray here: these functions take and return ``DataProto`` objects and plain Python values, so they
are unit-tested without a cluster.

Notation: ``B`` is the batch size (rows of a ``DataProto``), ``W`` the world size of a worker
group, ``S`` the sequence-parallel (SP) size and ``D = W / S`` the data-parallel (DP) size.

Ranks are laid out like ``torch.distributed.device_mesh.init_device_mesh(("dp", "sp"), (D, S))``:
``rank = dp_rank * S + sp_rank``, so the ``S`` consecutive ranks of one SP group receive the same
chunk of the batch and only the first of them (``sp_rank == 0``) returns the chunk's result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_ops.protocol import DataProto

__all__ = [
    "DPLayout",
    "DPRankInfo",
    "collect_dp_outputs",
    "gather_from_dp",
    "sequence_parallel_rank_info",
    "split_args_for_dp",
    "split_for_dp",
]


@dataclass(frozen=True, kw_only=True)
class DPRankInfo:
    """Where one rank sits in the data-parallel split, as that rank reports it."""

    dp_rank: int
    """Index of the batch chunk this rank computes on, in ``[0, dp_size)``."""
    dp_size: int
    """Number of chunks the batch is split into (``D``)."""
    is_collect_rank: bool
    """Whether the driver keeps this rank's result (exactly one rank per ``dp_rank``)."""


def sequence_parallel_rank_info(rank: int, *, world_size: int, sp_size: int) -> DPRankInfo:
    """DP position of ``rank`` when consecutive groups of ``sp_size`` ranks form SP groups.

    Example: ``world_size=4, sp_size=2`` gives ranks 0, 1 -> dp_rank 0 and ranks 2, 3 -> dp_rank 1;
    ranks 0 and 2 are the collect ranks.

    Raises:
        ValueError: If ``sp_size`` does not divide ``world_size`` or ``rank`` is out of range.
    """
    if sp_size < 1 or world_size % sp_size != 0:
        raise ValueError(
            f"sp_size={sp_size} must be >= 1 and divide world_size={world_size}; "
            "set the sequence-parallel size to a divisor of the number of ranks."
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}.")
    return DPRankInfo(dp_rank=rank // sp_size, dp_size=world_size // sp_size, is_collect_rank=rank % sp_size == 0)


@dataclass(frozen=True)
class DPLayout:
    """The DP position of every rank of a group, validated: index ``i`` is global rank ``i``."""

    ranks: tuple[DPRankInfo, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("DPLayout needs at least one rank.")
        dp_size = self.ranks[0].dp_size
        collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        for rank, info in enumerate(self.ranks):
            if info.dp_size != dp_size:
                raise ValueError(f"rank {rank} reports dp_size={info.dp_size} but rank 0 reports {dp_size}.")
            if not 0 <= info.dp_rank < dp_size:
                raise ValueError(f"rank {rank} reports dp_rank={info.dp_rank}, outside [0, {dp_size}).")
            if info.is_collect_rank:
                collectors[info.dp_rank].append(rank)
        bad = {d: r for d, r in collectors.items() if len(r) != 1}
        if bad:
            raise ValueError(
                f"every dp_rank needs exactly one collect rank; got collect ranks per dp_rank {bad}. "
                "Report is_collect_rank=True on one rank (e.g. sp_rank 0) of each data-parallel group."
            )

    @property
    def world_size(self) -> int:
        """Number of ranks (``W``)."""
        return len(self.ranks)

    @property
    def dp_size(self) -> int:
        """Number of batch chunks (``D``)."""
        return self.ranks[0].dp_size

    def dp_rank_of(self, rank: int) -> int:
        """The chunk index that global ``rank`` computes on."""
        return self.ranks[rank].dp_rank

    def collect_ranks(self) -> list[int]:
        """The global rank whose result is kept for each chunk, ordered by ``dp_rank``."""
        by_dp = {info.dp_rank: rank for rank, info in enumerate(self.ranks) if info.is_collect_rank}
        return [by_dp[d] for d in range(self.dp_size)]


def split_for_dp(data: DataProto, dp_size: int) -> tuple[list[DataProto], int]:
    """Pad ``data`` to a multiple of ``dp_size`` rows and split it into ``dp_size`` equal chunks.

    Padding repeats leading rows (``DataProto.pad_to_divisor``), so every chunk holds
    ``ceil(B / dp_size)`` real-looking rows; :func:`gather_from_dp` drops the padded rows again.

    Args:
        data: The batch, ``B`` rows.
        dp_size: Number of chunks (``D``).

    Returns:
        ``(chunks, pad_size)``: ``D`` chunks of ``(B + pad_size) / D`` rows in order, and the number
        of padded rows. Example: ``B=5, D=2`` -> chunks of 3 rows (rows 0-2 and 3, 4, 0), ``pad_size=1``.

    Raises:
        ValueError: If ``dp_size < 1`` or the batch is empty.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1.")
    if len(data) == 0:
        raise ValueError("cannot split an empty DataProto across data-parallel ranks; pass at least one row.")
    padded, pad_size = data.pad_to_divisor(dp_size)
    return padded.chunk(dp_size), pad_size


def gather_from_dp(outputs: Sequence[DataProto], pad_size: int) -> DataProto:
    """Concatenate per-chunk results in order and drop the last ``pad_size`` (padded) rows.

    Args:
        outputs: One result per chunk, ordered by ``dp_rank``.
        pad_size: The value :func:`split_for_dp` returned.

    Returns:
        The gathered batch, ``B`` rows, row ``i`` computed from input row ``i``.
    """
    if not outputs:
        raise ValueError("gather_from_dp needs at least one output.")
    return DataProto.concat(list(outputs)).unpad(pad_size)


def split_args_for_dp(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, dp_size: int
) -> tuple[list[tuple[tuple[Any, ...], dict[str, Any]]], int]:
    """Split every ``DataProto`` argument of a call into ``dp_size`` chunks; pass others unchanged.

    Args:
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.
        dp_size: Number of chunks (``D``).

    Returns:
        ``(per_dp, pad_size)``: ``per_dp[d]`` is the ``(args, kwargs)`` for chunk ``d``.

    Raises:
        TypeError: If no argument is a ``DataProto``.
        ValueError: If the ``DataProto`` arguments differ in length.
    """
    positions: list[int | str] = [i for i, a in enumerate(args) if isinstance(a, DataProto)]
    positions += [k for k, v in kwargs.items() if isinstance(v, DataProto)]
    if not positions:
        raise TypeError("a DP_COMPUTE_PROTO method needs at least one DataProto argument to split.")
    lengths = {str(p): len(args[p] if isinstance(p, int) else kwargs[p]) for p in positions}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"DataProto arguments must have the same length to be split together; got {lengths}.")
    per_dp_args = [list(args) for _ in range(dp_size)]
    per_dp_kwargs = [dict(kwargs) for _ in range(dp_size)]
    pad_size = 0
    for p in positions:
        chunks, pad_size = split_for_dp(args[p] if isinstance(p, int) else kwargs[p], dp_size)
        for d, chunk in enumerate(chunks):
            if isinstance(p, int):
                per_dp_args[d][p] = chunk
            else:
                per_dp_kwargs[d][p] = chunk
    return [(tuple(a), k) for a, k in zip(per_dp_args, per_dp_kwargs, strict=True)], pad_size


def collect_dp_outputs(outputs_by_rank: Sequence[Any], layout: DPLayout, *, pad_size: int, method: str) -> DataProto:
    """Keep the collect rank's output of every chunk and gather them (see :func:`gather_from_dp`).

    Args:
        outputs_by_rank: Every rank's return value, index = global rank.
        layout: The group's DP layout.
        pad_size: The value :func:`split_args_for_dp` returned.
        method: Method name, for error messages.

    Raises:
        TypeError: If a collected output is not a ``DataProto``.
    """
    if len(outputs_by_rank) != layout.world_size:
        raise ValueError(f"{method}: got {len(outputs_by_rank)} outputs for {layout.world_size} ranks.")
    kept = []
    for rank in layout.collect_ranks():
        out = outputs_by_rank[rank]
        if not isinstance(out, DataProto):
            raise TypeError(
                f"{method} is registered with Dispatch.DP_COMPUTE_PROTO, so it must return a DataProto; "
                f"rank {rank} returned {type(out).__name__}. Return metrics in DataProto.meta_info, or "
                "register the method with Dispatch.ONE_TO_ALL."
            )
        kept.append(out)
    return gather_from_dp(kept, pad_size)
