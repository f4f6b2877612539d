"""``training/rollout_probs_diff_*``: verl's rollout-vs-actor consistency metric, on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.trainer.metrics import compute_rollout_probs_diff


def test_diff_is_on_probabilities_over_response_tokens_only() -> None:
    # Row 0: probs rollout (0.5, 0.25, .) vs actor (0.4, 0.25, .), its 3rd token is padding (a 0.9 gap that
    # must not count). Row 1: rollout 0.2 vs actor 0.3 on its only token.
    # |diff| over the 3 kept tokens = (0.1, 0.0, 0.1): max 0.1, mean 0.2/3, sample std sqrt(0.00667/2).
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.05], [0.2, 0.9, 0.9]]))
    actor = torch.log(torch.tensor([[0.4, 0.25, 0.95], [0.3, 0.1, 0.1]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = compute_rollout_probs_diff(rollout, actor, mask)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1, abs=1e-7)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.2 / 3, abs=1e-7)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(0.02 / 3 / 2), abs=1e-7)
    # Pearson of (0.5, 0.25, 0.2) and (0.4, 0.25, 0.3): centred (0.18333, -0.06667, -0.11667) and
    # (0.08333, -0.06667, -0.01667); dot 0.021667 / (0.22730 * 0.10801) = 0.8825.
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(0.8825, abs=1e-3)


def test_log_prob_gap_on_unlikely_tokens_barely_counts() -> None:
    # log-probs -20 vs -10 differ by 10 nats but the probabilities by e^-10 - e^-20 = 4.54e-5.
    m = compute_rollout_probs_diff(torch.tensor([[-20.0]]), torch.tensor([[-10.0]]), torch.ones(1, 1))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(math.exp(-10) - math.exp(-20), rel=1e-6)
    assert m["training/rollout_probs_diff_std"] == 0.0  # one token: no spread (torch.std would be nan)
    assert "training/rollout_actor_probs_pearson_corr" not in m  # undefined for one token


def test_no_response_token_gives_no_metric_and_shapes_are_checked() -> None:
    assert compute_rollout_probs_diff(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)) == {}
    with pytest.raises(ValueError, match=r"must all be \(B, R\)"):
        compute_rollout_probs_diff(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))
