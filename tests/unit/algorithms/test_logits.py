"""Tests for rlhf_ops.algorithms.logits against torch references and hand values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.algorithms import entropy_from_logits, logprobs_from_logits


def _logits(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 11, generator=gen) * 3).to(dtype)


LABELS = torch.tensor([[0, 5, 10], [3, 3, 7]])


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])  # 4 leaves a remainder chunk of 2 rows out of 6
def test_logprobs_match_log_softmax_gather(chunk_size: int):
    logits = _logits().requires_grad_(True)
    out = logprobs_from_logits(logits, LABELS, chunk_size=chunk_size)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_logits, dim=-1).gather(-1, LABELS.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_logprobs_of_bf16_logits_are_fp32():
    logits = _logits(torch.bfloat16)
    out = logprobs_from_logits(logits, LABELS)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), dim=-1).gather(-1, LABELS.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)


def test_logprobs_and_entropy_are_stable_for_huge_logits():
    # two tied logits of 1000 (exp overflows fp32): p = 1/2 each -> log p = -ln 2, entropy ln 2
    logits = torch.tensor([[1000.0, 1000.0, -1000.0]])
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([0])), torch.tensor([-math.log(2)]))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2)]))


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_entropy_matches_categorical(chunk_size: int):
    logits = _logits().requires_grad_(True)
    out = entropy_from_logits(logits, chunk_size=chunk_size)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.distributions.Categorical(logits=ref_logits).entropy()
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_entropy_hand_values():
    # uniform over 4 -> ln 4 = 1.386294 ; a masked (-inf) entry contributes 0, not NaN: uniform over 2 -> ln 2
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("-inf"), float("-inf")]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), math.log(2)]))


def test_empty_inputs_give_empty_outputs():
    logits = torch.zeros(0, 7)
    assert logprobs_from_logits(logits, torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert entropy_from_logits(logits).shape == (0,)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(_logits(), LABELS[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(_logits(), chunk_size=0)
