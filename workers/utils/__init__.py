"""Worker-side batch utilities: micro-batching, sequence-length balancing, remove padding, dp collectives."""

from __future__ import annotations

from rlhf_ops.seqlen_balancing import balance_batch_across_dp, karmarkar_karp, partition_sums
from workers.utils.dist import MetricAccumulator, all_reduce, dp_world_size, global_counts
from workers.utils.micro_batch import (
    make_micro_batches,
    rearrange_micro_batches,
    restore_order,
    split_fixed,
    split_mini_batches,
)
from workers.utils.remove_padding import PackedBatch, pack_sequences, scatter_response

__all__ = [
    "MetricAccumulator",
    "PackedBatch",
    "all_reduce",
    "balance_batch_across_dp",
    "dp_world_size",
    "global_counts",
    "karmarkar_karp",
    "make_micro_batches",
    "pack_sequences",
    "partition_sums",
    "rearrange_micro_batches",
    "restore_order",
    "scatter_response",
    "split_fixed",
    "split_mini_batches",
]
