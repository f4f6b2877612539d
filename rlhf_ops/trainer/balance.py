"""Balancing a step's rows across data-parallel ranks by token count (verl's ``_balance_batch``)."""

from __future__ import annotations

from rlhf_ops.protocol import DataProto


def balance_tokens_across_ranks(
    batch: DataProto, *, dp_size: int, keep_groups: bool = False
) -> tuple[DataProto, float]:
    """Reorders rows so each data-parallel chunk holds about the same number of tokens (verl's
    ``_balance_batch``); returns the batch and max/min tokens per rank after balancing. With ``keep_groups``
    whole ``uid`` groups move together (``actor.share_prompt_prefix``), where they deal out evenly."""
    from rlhf_ops.seqlen_balancing import balance_batch_across_dp, balance_groups_across_dp

    mask = batch.tensors["attention_mask"]
    if dp_size <= 1 or len(batch) % dp_size:
        return batch, 1.0
    order = None
    if keep_groups and "uid" in batch.non_tensor_batch:
        order = balance_groups_across_dp(mask, list(batch.non_tensor_batch["uid"]), dp_size)
    balanced = batch.reorder(order if order is not None else balance_batch_across_dp(mask, dp_size))
    per_rank = balanced.tensors["attention_mask"].sum(-1).view(dp_size, -1).sum(-1).float()
    return balanced, (per_rank.max() / per_rank.min().clamp(min=1)).item()
