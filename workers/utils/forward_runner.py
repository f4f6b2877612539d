"""What the actor, the reference and the critic share: the parallel-group checks, the no-grad forward loop and
the packed (remove padding / Ulysses) forward.

Notation: B = rows on this rank, R = response length, K = response-predicting positions of a packed row,
k_r = those on this SP rank.

Each role supplies only its per-micro-batch forward (log-probs of a causal LM, values of a value head); the
runner splits the batch (fixed rows or a token budget, ``rlhf_ops.config.batch_plan.ForwardPlan``), keeps the
Ulysses context open, and returns the results in the input's row order. :func:`forward_packed` runs the model on
one packed row, or on this rank's slice of it under Ulysses, and hands back the outputs at the positions that
predict response tokens with a ``collect`` that turns per-position results into the whole row's (K,).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf_ops.config.batch_plan import ForwardPlan, MeshPlan
from rlhf_ops.protocol import DataProto
from workers.sp.ulysses import (
    check_ulysses_heads,
    enable_ulysses_attention,
    shard_packed,
    sp_world_size,
    ulysses_sequence_parallel,
)
from workers.utils.dist import dp_world_size
from workers.utils.micro_batch import make_micro_batches, restore_order
from workers.utils.remove_padding import PackedBatch

__all__ = ["PackedForward", "check_parallel_groups", "forward_micro_batches", "forward_packed"]

MicroForward = Callable[[DataProto], Sequence[Tensor | None]]


def check_parallel_groups(
    role: str,
    module: nn.Module,
    *,
    mesh: MeshPlan,
    dp_group: dist.ProcessGroup | None,
    sp_group: dist.ProcessGroup | None,
    use_remove_padding: bool,
) -> tuple[int, int]:
    """``(dp_size, sp_size)`` of the groups, checked against the plan's mesh; with sp > 1 the module's
    attention is switched to Ulysses.

    Raises:
        ValueError: a group's size differs from the plan's, or sp > 1 without ``<role>.use_remove_padding``
            (Ulysses shards the packed row) or with a head count sp does not divide.
    """
    dp_size, sp_size = dp_world_size(dp_group), sp_world_size(sp_group)
    if dp_size != mesh.dp_size:
        raise ValueError(
            f"the dp group has {dp_size} ranks but plan.mesh.dp_size is {mesh.dp_size}; derive the "
            "plan for this world size (derive_batch_plan) or pass the matching dp_group."
        )
    if sp_size != mesh.sp_size:
        raise ValueError(
            f"the sp group has {sp_size} ranks but plan.mesh.sp_size is {mesh.sp_size}; pass the "
            f"sp_group of workers.fsdp.mesh.sp_process_groups for {role}.ulysses_sequence_parallel_size."
        )
    if sp_size > 1:
        if not use_remove_padding:
            raise ValueError(
                f"{role}.ulysses_sequence_parallel_size={sp_size} shards packed sequences: set "
                f"{role}.use_remove_padding=True."
            )
        check_ulysses_heads(getattr(module, "config", None), sp_size)
        enable_ulysses_attention(module)
    return dp_size, sp_size


def forward_micro_batches(
    data: DataProto,
    sizes: ForwardPlan,
    forward: MicroForward,
    *,
    dp_group: dist.ProcessGroup | None,
    sp_group: dist.ProcessGroup | None,
    out_device: torch.device,
) -> list[Tensor | None]:
    """Runs ``forward`` on every micro-batch of ``data`` without gradient; returns each of its outputs
    concatenated over the micro-batches in the input's row order (None where ``forward`` returned None).

    A collective under FSDP: every rank of the dp group must call it with the same number of micro-batches,
    which the token-budget split guarantees by all-reducing its count; with fixed-size micro-batches dispatch
    equal row counts. The Ulysses block stays open so each SP rank forwards its slice of the packed rows.
    """
    micro_batches, indices = make_micro_batches(
        data,
        use_dynamic_bsz=sizes.use_dynamic_bsz,
        micro_batch_size=sizes.micro_batch_size_per_rank,
        max_token_len=sizes.max_token_len_per_rank,
        dp_group=dp_group,
    )
    columns: list[list[Tensor]] | None = None
    with torch.no_grad(), ulysses_sequence_parallel(sp_group):
        for micro in micro_batches:
            outputs = forward(micro)
            if columns is None:
                columns = [[] for _ in outputs]
            for column, out in zip(columns, outputs, strict=True):
                if out is not None:
                    column.append(out)
    return [restore_order(column, indices).to(out_device) if column else None for column in columns or []]


@dataclass(frozen=True)
class PackedForward:
    """The model's outputs at the positions of a packed row that predict response tokens."""

    outputs: Tensor
    """(k, ...) ``logits`` at those positions held by this rank (k = K without Ulysses, k_r with it)."""
    labels: Tensor
    """(k,) the response tokens they predict."""
    collect: Callable[[Tensor], Tensor]
    """Per-position results (k,) -> (K,) of the whole row (gathered over the SP group; identity without)."""


def forward_packed(
    module: nn.Module,
    packed: PackedBatch,
    *,
    sp_group: dist.ProcessGroup | None,
    keep_logits: bool = False,
    media: dict[str, Tensor] | None = None,
) -> PackedForward:
    """One forward of ``packed`` without padding; with an SP group of > 1 ranks, of this rank's slice of it.

    Args:
        module: Causal LM or value model returning ``.logits`` (1, n, ...).
        packed: :func:`workers.utils.remove_padding.pack_sequences` of the micro-batch.
        sp_group: Ulysses group (all its ranks call with the same micro-batch); None or 1 rank: no SP.
        keep_logits: Pass ``logits_to_keep`` so the LM head runs only on the kept positions (causal LMs).
        media: Extra model inputs (``pixel_values``; not with Ulysses).
    """
    extra: dict[str, Tensor] = dict(media or {})
    if sp_world_size(sp_group) > 1:
        shard = shard_packed(packed.input_ids, packed.position_ids, group=sp_group)
        local, index = shard.select(packed.keep)  # (K,) bool, (k_r,) local columns predicting response tokens
        if keep_logits:
            extra["logits_to_keep"] = index
        with ulysses_sequence_parallel(sp_group):
            out = module(
                input_ids=shard.input_ids,
                position_ids=shard.position_ids,
                attention_mask=None,
                use_cache=False,
                **extra,
            )
        outputs = out.logits[0] if keep_logits else out.logits[0, index]  # (k_r, ...)
        return PackedForward(
            outputs,
            packed.labels[local],
            lambda values: shard.gather(values, index)[packed.keep],  # (N_pad,) over the group -> (K,)
        )
    if keep_logits:
        extra["logits_to_keep"] = packed.keep
    out = module(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=packed.attention_mask,
        use_cache=False,
        **extra,
    )
    outputs = out.logits[0] if keep_logits else out.logits[0, packed.keep]  # (K, ...)
    return PackedForward(outputs, packed.labels, lambda values: values)
