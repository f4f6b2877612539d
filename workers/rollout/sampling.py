"""Token sampling from next-token logits: temperature, top-k, top-p, greedy, and the recorded log-prob.

Notation: B = rows decoding in lock-step, V = vocabulary size. Pure torch; all maths in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.rollout.base import LogprobsMode, SamplingParams


def filter_logits(logits: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """Sets logits outside the top-k set and outside the top-p nucleus to -inf.

    Args:
        logits: (B, V) float logits (already divided by the temperature).
        top_k: Keep the k largest; -1 / 0 (or k >= V) keeps all.
        top_p: Keep the smallest set of most likely tokens whose mass reaches ``top_p``; 1 keeps all.

    Returns:
        (B, V) new tensor; the most likely token of every row is always kept.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]  # (B, 1) k-th largest logit
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, V) mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p  # column 0 has mass_before 0 < top_p: never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next_tokens(
    logits: Tensor, params: SamplingParams, *, generator: torch.Generator | None, logprobs_mode: LogprobsMode
) -> tuple[Tensor, Tensor]:
    """Picks one token per row and its log-prob.

    Args:
        logits: (B, V) raw next-token logits of the model (any float dtype).
        params: Sampling settings; greedy takes the argmax of the raw logits.
        generator: Random generator on ``logits.device`` (None: the global one).
        logprobs_mode: ``"raw"``: ``log_softmax(logits)`` at temperature 1, unfiltered; ``"processed"``:
            ``log_softmax`` of the filtered, temperature-scaled logits sampled from (raw when greedy).

    Returns:
        ``(tokens, logprobs)``: (B,) int64 token ids and (B,) float32 log-probs of those tokens.
    """
    raw = logits.float()
    if params.greedy:
        tokens = raw.argmax(dim=-1)
        processed = raw
    else:
        processed = filter_logits(raw / params.temperature, top_k=params.top_k, top_p=params.top_p)
        probs = torch.softmax(processed, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    source = raw if logprobs_mode == "raw" else processed
    logprobs = torch.log_softmax(source, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
