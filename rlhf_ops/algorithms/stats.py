"""Masked reductions shared by the advantage estimators and the losses (verl semantics).

Shape notation: B: batch size, T: response length. A ``mask`` is 1 on valid response tokens and 0 on
padding; it has the shape of ``values`` (or broadcasts to it).
"""

from __future__ import annotations

import torch
from torch import Tensor

Axis = int | tuple[int, ...] | None

# verl adds this to the mask count in masked_mean and to the variance in masked_whiten; kept for parity.
_EPS = 1e-8


def masked_sum(values: Tensor, mask: Tensor, axis: Axis = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set, weighted by ``mask``.

    Padded positions are replaced by zeros before the multiply, so a NaN or inf there (e.g. a log-prob
    of a padding token) cannot leak into the sum through ``0 * inf``.

    Args:
        values: Any shape, e.g. (B, T).
        mask: Same shape as ``values`` (or broadcastable); 0/1 or fractional weights.
        axis: Dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        The masked sum, with ``axis`` reduced.
    """
    mask = mask.to(values.dtype)
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: Axis = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set (verl ``masked_mean``).

    The denominator is ``mask.sum(axis) + 1e-8`` as in verl, so an all-zero mask gives 0, not NaN.

    Args:
        values: Any shape, e.g. (B, T).
        mask: Same shape as ``values``.
        axis: Dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        The masked mean, with ``axis`` reduced.
    """
    mask = mask.to(values.dtype)
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + _EPS)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over all masked positions (a scalar), as verl ``masked_var``.

    Args:
        values: Any shape, e.g. (B, T).
        mask: Same shape as ``values``.
        unbiased: Apply Bessel's correction ``n / (n - 1)`` with ``n = mask.sum()``.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: With ``unbiased=True``, when the mask selects fewer than two elements.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("mask selects no element: at least one element of mask must be 1.")
        if mask_sum == 1:
            raise ValueError("mask selects one element: the unbiased variance needs two; pass unbiased=False.")
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise ``values`` to mean 0 and (unbiased) variance 1 over the mask (verl ``masked_whiten``).

    Statistics come from the masked positions only; every position (padding included) is transformed,
    so callers multiply by the mask afterwards when padding must be zero.

    Args:
        values: Any shape, e.g. (B, T).
        mask: Same shape as ``values``; must select at least two elements.
        shift_mean: If False, the mean is added back (only the scale is normalised).

    Returns:
        Tensor shaped like ``values``.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + _EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
