"""Tests for rlhf_ops.algorithms.stats (masked reductions, verl semantics)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlhf_ops.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_all_and_per_row():
    # valid: 1, 2 | 4 -> total 7, rows 3 and 4
    torch.testing.assert_close(masked_sum(VALUES, MASK), torch.tensor(7.0))
    torch.testing.assert_close(masked_sum(VALUES, MASK, axis=-1), torch.tensor([3.0, 4.0]))


def test_masked_sum_ignores_nan_and_inf_on_padding():
    values = torch.tensor([[1.0, float("nan"), float("-inf")]])
    mask = torch.tensor([[1, 0, 0]])  # integer mask works too
    torch.testing.assert_close(masked_sum(values, mask), torch.tensor(1.0))


def test_masked_mean_all_rows_and_empty_mask():
    # 7 / 3 over all; rows: 3 / 2 = 1.5 and 4 / 1 = 4
    torch.testing.assert_close(masked_mean(VALUES, MASK), torch.tensor(7.0 / 3.0))
    torch.testing.assert_close(masked_mean(VALUES, MASK, axis=-1), torch.tensor([1.5, 4.0]))
    # empty mask: 0 / (0 + 1e-8) = 0, not NaN (verl)
    torch.testing.assert_close(masked_mean(VALUES, torch.zeros_like(MASK)), torch.tensor(0.0))


def test_masked_var_biased_and_unbiased():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2; squared deviations 1, 0, 1 -> biased 2/3, unbiased 2/3 * 3/2 = 1
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(2.0 / 3.0))
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(1.0))


def test_masked_var_rejects_too_few_elements():
    values = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="no element"):
        masked_var(values, torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="unbiased=False"):
        masked_var(values, torch.tensor([1.0, 0.0]))
    # one element, biased: variance 0
    torch.testing.assert_close(masked_var(values, torch.tensor([1.0, 0.0]), unbiased=False), torch.tensor(0.0))


def test_masked_whiten_hand_values():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8) on the valid tokens
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out[:, :3], torch.tensor([[-1.0, 0.0, 1.0]]))
    # padding is transformed too (callers mask afterwards): (50 - 2) / 1 = 48
    torch.testing.assert_close(out[:, 3], torch.tensor([48.0]))
    # shift_mean=False adds the mean back: [-1, 0, 1] + 2
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False)[:, :3], torch.tensor([[1.0, 2.0, 3.0]]))


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.1, 100.0),
)
def test_masked_whiten_gives_mean_zero_unit_variance_over_mask(rows: int, cols: int, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale + 3.0
    mask = (torch.rand(rows, cols, generator=gen) < 0.7).double()
    assume(mask.sum() >= 2)
    assume(masked_var(values, mask).item() > 1e-2)
    out = masked_whiten(values, mask)
    # verl's denominator mask.sum() + 1e-8 biases the mean by ~mean * 1e-8 / count, i.e. by
    # ~5e-9 * |mean| / std after whitening: the tolerance scales with |mean| / std.
    mean, std = masked_mean(values, mask).item(), masked_var(values, mask).sqrt().item()
    assert math.isclose(masked_mean(out, mask).item(), 0.0, abs_tol=1e-6 * (1.0 + abs(mean) / std))
    assert math.isclose(masked_var(out, mask).item(), 1.0, rel_tol=1e-5)
