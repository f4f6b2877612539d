"""Which log-probs the engines report, and when they compare with the actor's (rlhf_ops.sampling)."""

from __future__ import annotations

import pytest
import torch

from rlhf_ops.sampling import SamplingParams, rollout_logprobs_comparable, rollout_logprobs_mode
from workers.rollout.sampling import sample_next_tokens


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "mode", "comparable"),
    [
        (1.0, 1.0, -1, "processed", True),  # processed == raw at temperature 1
        (0.7, 1.0, -1, "processed", True),  # the smollm2 preset: the actor recomputes log_softmax(logits / 0.7)
        (0.7, 1.0, 0, "processed", True),  # HF's "top-k off"
        (0.7, 0.9, -1, "raw", False),  # a truncated distribution the actor cannot recompute
        (1.0, 0.9, -1, "raw", True),  # raw at temperature 1 is the actor's temperature-1 recompute
        (0.7, 1.0, 50, "raw", False),
    ],
)
def test_mode_and_comparability(temperature: float, top_p: float, top_k: int, mode: str, comparable: bool) -> None:
    assert rollout_logprobs_mode(temperature=temperature, top_p=top_p, top_k=top_k) == mode
    assert rollout_logprobs_comparable(temperature=temperature, top_p=top_p, top_k=top_k) is comparable


def test_processed_logprobs_are_the_actors_at_the_sampling_temperature() -> None:
    # The actor's update computes log_softmax(logits / T) of the sampled token; "processed" must report exactly that.
    torch.manual_seed(0)
    logits = torch.randn(4, 11) * 3
    params = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1)
    gen = torch.Generator().manual_seed(1)
    tokens, logprobs = sample_next_tokens(logits, params, generator=gen, logprobs_mode="processed")
    actor = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, actor, atol=1e-6)
    raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (logprobs - raw).abs().max() > 0.05  # raw (temperature 1) would be off by this much
