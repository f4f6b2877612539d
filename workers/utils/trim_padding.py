"""Padding columns cut from a padded micro-batch before its forward (the path without remove padding).

Notation: b = rows of the micro-batch, T = P + R full length, R = response length, R' = R - cut on the right.

A micro-batch of left-padded prompts and right-padded responses often has columns that are padding in every
row: the first ones when its longest prompt is shorter than the batch's P, the last ones when its longest
response ended before R (a rollout is padded to ``max_new_tokens``; most responses end far earlier). The model
computes those columns anyway and attention masks them out, so cutting them changes no valid output and saves
their share of the forward and the backward (measured in ``bench/bench_trim_padding.py``). Only edge columns go:
a column inside a row's span (an observation token of a multi-turn response) stays, and so does the prompt's last
column, which predicts the first response token. Results are padded back to (b, R) with zeros, which lie outside
the response mask like every padding column's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

__all__ = ["TrimmedBatch", "trim_padding_columns"]


@dataclass(frozen=True)
class TrimmedBatch:
    """A padded micro-batch without its all-padding edge columns."""

    input_ids: Tensor
    """(b, T') the kept columns."""
    attention_mask: Tensor
    """(b, T')."""
    position_ids: Tensor
    """(..., b, T') the kept columns of the batch's own positions (unchanged values)."""
    response_length: int
    """R': response columns kept (>= 1)."""
    cut_right: int
    """R - R': trailing response columns cut."""

    def restore(self, values: Tensor) -> Tensor:
        """Per-response-column results (b, R', ...) -> (b, R, ...), zeros in the columns cut."""
        if self.cut_right == 0:
            return values
        # F.pad pads the last dims first: (0, 0) per trailing dim, then (0, cut_right) for dim 1.
        widths = (0, 0) * (values.dim() - 2) + (0, self.cut_right)
        return F.pad(values, widths)


def trim_padding_columns(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *, response_length: int
) -> TrimmedBatch:
    """Cuts the leading and trailing columns that are padding in every row (``attention_mask`` 0 in all rows).

    Args:
        input_ids: (b, T), prompt columns first, then R response columns.
        attention_mask: (b, T).
        position_ids: (b, T), or (k, b, T) for multi-axis positions; sliced on the last dim.
        response_length: R.
    """
    total = attention_mask.shape[-1]
    valid = attention_mask.bool().any(dim=0)  # (T,)
    if bool(valid.all()) or not bool(valid.any()):
        return TrimmedBatch(input_ids, attention_mask, position_ids, response_length, 0)
    cols = valid.nonzero().flatten()
    prompt_length = total - response_length
    first = min(int(cols[0]), prompt_length - 1)  # the prompt's last column predicts response token 0
    cut_right = min(total - 1 - int(cols[-1]), response_length - 1)  # keep at least one response column
    end = total - cut_right
    return TrimmedBatch(
        input_ids[:, first:end],
        attention_mask[:, first:end],
        position_ids[..., first:end],
        response_length - cut_right,
        cut_right,
    )
