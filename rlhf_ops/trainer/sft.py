"""Supervised fine-tuning on chat conversations: rows -> token ids + loss masks -> micro-batches -> loss.

The pieces of ``rlhf sft`` that need no process group (the loop that owns the model and the optimizer is
``workers/sft/trainer.py``). Conversations are encoded by :func:`rlhf_ops.agent.transcript.encode_conversation`,
the agent loop's own layout, so a model fine-tuned here reads and writes the token sequences it meets in
multi-turn RL. The loss is the next-token cross-entropy on assistant tokens only, summed and divided by the
number of assistant tokens of the whole optimizer step (``num_tokens``), so gradients do not depend on how the
step was split into micro-batches.

Notation: B conversations in a micro-batch, T the longest of them (right-padded), V the vocabulary.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_ops.agent.chat_format import ObservationRenderer
from rlhf_ops.agent.tools import ToolExample
from rlhf_ops.agent.transcript import conversation_problem, encode_conversation


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One encoded conversation: ``input_ids`` and ``loss_mask`` of equal length T."""

    input_ids: list[int]
    loss_mask: list[int]


def sft_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor, *, num_tokens: float) -> tuple[Tensor, Tensor]:
    """Next-token cross-entropy on the masked tokens, summed and divided by ``num_tokens``.

    Shapes: ``logits`` (B, T, V), ``input_ids`` and ``loss_mask`` (B, T). Position t predicts token t + 1, so
    token t + 1 counts iff ``loss_mask[:, t + 1]`` is 1 (the first token of a row is never predicted).

    Returns:
        (loss, the summed token losses before the division): the second, detached, is what the step logs.
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(logits.dtype)
    token_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none")  # (B, T-1)
    summed = (token_loss * mask).sum()
    return summed / num_tokens, summed.detach()


def encode_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    eos_token_id: int,
    schemas: Sequence[dict[str, Any]],
    examples: Sequence[ToolExample],
    max_length: int,
    source: str,
) -> list[SFTExample]:
    """Every row's conversation (its ``messages``) encoded in the agent loop's layout.

    Raises:
        ValueError: one line naming ``data.train_files``, the source, the row and what is wrong (no
            ``messages``, a malformed conversation, longer than ``max_length`` tokens).
    """
    renderer = ObservationRenderer(tokenizer)
    out = []
    for index, row in enumerate(rows):
        where = f"data.train_files: {source} row {index}"
        problem = conversation_problem(row.get("messages")) if isinstance(row, Mapping) else "it is not a mapping"
        if problem is not None:
            raise ValueError(f"{where}: {problem}; fix the row (rows are {{'messages': [...]}}, OpenAI chat format)")
        ids, mask = encode_conversation(
            tokenizer,
            row["messages"],
            eos_token_id=eos_token_id,
            schemas=schemas,
            examples=examples,
            renderer=renderer,
        )
        if len(ids) > max_length:
            raise ValueError(f"{where}: {len(ids)} tokens > data.max_length={max_length}; raise it or shorten the row")
        out.append(SFTExample(ids, mask))
    return out


def collate(examples: Sequence[SFTExample], *, pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask``, each (B, T) with T the longest row."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(example.loss_mask)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def epoch_steps(
    num_examples: int, *, epoch: int, seed: int, micro_batch_size: int, grad_accum_steps: int
) -> list[list[list[int]]]:
    """The optimizer steps of one epoch: each a list of ``grad_accum_steps`` micro-batches of row indices.

    Rows are shuffled by ``(seed, epoch)``; the last step may hold fewer rows (its last micro-batch too), so every
    row is seen once per epoch.
    """
    order = list(range(num_examples))
    random.Random(f"sft-{seed}-{epoch}").shuffle(order)
    rows_per_step = micro_batch_size * grad_accum_steps
    steps = []
    for first in range(0, num_examples, rows_per_step):
        rows = order[first : first + rows_per_step]
        steps.append([rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)])
    return steps


def steps_per_epoch(num_examples: int, *, micro_batch_size: int, grad_accum_steps: int) -> int:
    """Optimizer steps in one epoch (the learning-rate schedule's length is this times the epochs)."""
    return -(-num_examples // (micro_batch_size * grad_accum_steps))
