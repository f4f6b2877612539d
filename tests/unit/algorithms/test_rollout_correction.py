"""verl's rollout importance sampling (``rlhf_ops.algorithms.rollout_correction``), hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.algorithms.rollout_correction import rollout_is_weights

LOG2 = math.log(2.0)


def test_token_level_weights_are_capped_per_token_and_zero_on_masked_tokens() -> None:
    # log-ratios old - rollout: row 0 = [log 2, log 4, 0 (masked)], row 1 = [-log 2, log 8, 0]; mask holes on
    # the last token of row 0 (an observation) and of row 1. Raw weights [2, 4, -] and [0.5, 8, -]; cap 3.
    old = torch.tensor([[LOG2, 2 * LOG2, 5.0], [-LOG2, 3 * LOG2, 5.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    weights, metrics = rollout_is_weights(old, rollout, mask, level="token", threshold=3.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 3.0, 0.0], [0.5, 3.0, 0.0]]))
    # Before the cap: (2 + 4 + 0.5 + 8) / 4 = 3.625; above the cap: 4 and 8 -> 2 / 4.
    torch.testing.assert_close(metrics["rollout_corr/rollout_is_mean"], torch.tensor(3.625))
    torch.testing.assert_close(metrics["rollout_corr/rollout_is_ratio_fraction_high"], torch.tensor(0.5))
    # k1 of KL(rollout || old) = mean(rollout - old) = -(log 2 + 2 log 2 - log 2 + 3 log 2) / 4 = -5/4 log 2.
    torch.testing.assert_close(metrics["rollout_corr/kl"], torch.tensor(-1.25 * LOG2))


def test_sequence_level_weight_is_the_capped_product_over_the_row_on_every_valid_token() -> None:
    # Row 0: exp(log 2 + log 2) = 4 -> cap 3; row 1: exp(log 2 - log 4) = 0.5. The masked token's ratio (e^5)
    # is left out of the product.
    old = torch.tensor([[LOG2, LOG2, 5.0], [LOG2, -2 * LOG2, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights, metrics = rollout_is_weights(old, torch.zeros(2, 3), mask, level="sequence", threshold=3.0)
    torch.testing.assert_close(weights, torch.tensor([[3.0, 3.0, 0.0], [0.5, 0.5, 0.5]]))
    # Token-weighted means: (4 + 4 + 0.5 * 3) / 5 = 1.9; above the cap: 2 of 5 tokens.
    torch.testing.assert_close(metrics["rollout_corr/rollout_is_mean"], torch.tensor(1.9))
    torch.testing.assert_close(metrics["rollout_corr/rollout_is_ratio_fraction_high"], torch.tensor(0.4))


def test_equal_policies_give_weight_one_and_wild_ratios_stay_finite() -> None:
    logp = torch.tensor([[-0.3, -1.2]])
    weights, _ = rollout_is_weights(logp, logp.clone(), torch.ones(1, 2), level="token", threshold=2.0)
    torch.testing.assert_close(weights, torch.ones(1, 2))
    wild, metrics = rollout_is_weights(
        torch.tensor([[0.0, 0.0]]), torch.tensor([[-100.0, 100.0]]), torch.ones(1, 2), level="token", threshold=2.0
    )
    torch.testing.assert_close(wild, torch.tensor([[2.0, math.exp(-20.0)]]))  # clamped to [-20, 20] first
    assert torch.isfinite(metrics["rollout_corr/rollout_is_mean"])


def test_bad_arguments_name_the_problem() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0"):
        rollout_is_weights(x, x, x, level="token", threshold=0.0)
    with pytest.raises(ValueError, match="same \\(B, T\\) shape"):
        rollout_is_weights(x, torch.zeros(1, 3), x, level="token", threshold=2.0)
    with pytest.raises(ValueError, match="choose 'token' or 'sequence'"):
        rollout_is_weights(x, x, x, level="geometric", threshold=2.0)  # type: ignore[arg-type]
