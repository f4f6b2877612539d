"""Ulysses sequence parallelism: all-to-all attention over an SP group, sharding and gather helpers."""

from __future__ import annotations

from workers.sp.ulysses import (
    ATTENTION_PREFIX,
    SPShard,
    all_to_all,
    enable_ulysses_attention,
    gather_seq,
    packed_causal_mask,
    shard_packed,
    sp_rank,
    sp_world_size,
    ulysses_attention_forward,
    ulysses_sequence_parallel,
)

__all__ = [
    "ATTENTION_PREFIX",
    "SPShard",
    "all_to_all",
    "enable_ulysses_attention",
    "gather_seq",
    "packed_causal_mask",
    "shard_packed",
    "sp_rank",
    "sp_world_size",
    "ulysses_attention_forward",
    "ulysses_sequence_parallel",
]
