"""Tests for rlhf_ops.algorithms.kl: estimators, straight-through gradients, controllers, KL in reward."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.algorithms import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])
# d = logp - ref = [0.5, -1.0]; k3 uses r = ref - logp = [-0.5, 1.0]: exp(r) - r - 1
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # [0.10653, 0.71828]
EXPECTED = {
    "kl": [0.5, -1.0],
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "mse": [0.125, 0.5],  # d^2 / 2
    "k2": [0.125, 0.5],
    "low_var_kl": K3,
    "k3": K3,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_estimator_values(name: str):
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), torch.tensor([EXPECTED[name]]))


def test_low_var_kl_is_clamped_to_ten():
    # r = 15 -> exp(15) - 16 ~ 3.3e6 -> 10 ; r = -30 is clamped to -20 first: exp(-20) + 19 ~ 19 -> 10
    out = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([15.0, -30.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_straight_through_keeps_value_and_takes_k2_gradient(name: str):
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, f"{name}+")
    torch.testing.assert_close(out, torch.tensor([EXPECTED[name]]))
    out.sum().backward()
    # d/dlogp of k2 = d^2 / 2 is d = [0.5, -1.0], whatever the forward estimator
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -1.0]]))


def test_plain_k3_gradient_differs_from_straight_through():
    # d/dlogp (exp(ref - logp) - (ref - logp) - 1) = 1 - exp(ref - logp) = [1 - e^-0.5, 1 - e]
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k3").sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e]]))


@pytest.mark.parametrize("name", ["full", "k4", "KL", "k3++", ""])
def test_unknown_estimator_raises_with_valid_names(name: str):
    with pytest.raises(ValueError, match="kl_penalty=.*low_var_kl"):
        kl_penalty(LOGP, REF, name)


def test_name_table_has_every_base_and_plus_variant():
    assert set(KL_PENALTY_NAMES) == set(EXPECTED) | {f"{n}+" for n in EXPECTED}


def test_fixed_controller_never_moves_and_round_trips():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05
    other = FixedKLController(kl_coef=0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_update_rule():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    # kl 9: error 9/6 - 1 = 0.5, clipped to 0.2 -> mult 1 + 0.2 * 256 / 10000 = 1.00512
    ctrl.update(current_kl=9.0, n_steps=256)
    assert math.isclose(ctrl.value, 0.1 * 1.00512)
    # kl on target: error 0 -> unchanged
    ctrl.update(current_kl=6.0, n_steps=256)
    assert math.isclose(ctrl.value, 0.1 * 1.00512)
    # kl 5.4 (a tensor, as the trainer may pass): error -0.1 (inside the clip) -> mult 1 - 0.1 * 1000 / 10000 = 0.99
    ctrl.update(current_kl=torch.tensor(5.4), n_steps=1000)  # type: ignore[arg-type]
    assert math.isclose(ctrl.value, 0.1 * 1.00512 * 0.99, rel_tol=1e-6)  # fp32 5.4 != 5.4 exactly
    # kl 0: error -1 clipped to -0.2 -> mult 1 - 0.2 * 5000 / 10000 = 0.9
    before = ctrl.value
    ctrl.update(current_kl=0.0, n_steps=5000)
    assert math.isclose(ctrl.value, before * 0.9)


def test_adaptive_controller_state_round_trip():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctrl.update(current_kl=9.0, n_steps=256)
    resumed = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value
    with pytest.raises(ValueError, match="'value'"):
        resumed.load_state_dict({"kl_coef": 0.2})


@pytest.mark.parametrize(("target_kl", "horizon", "field"), [(0.0, 100, "target_kl"), (6.0, 0, "horizon")])
def test_adaptive_controller_validates(target_kl: float, horizon: int, field: str):
    with pytest.raises(ValueError, match=field):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=target_kl, horizon=horizon)


SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
OLD = torch.full((2, 3), -1.0)
REF_LP = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_apply_kl_penalty_with_fixed_controller():
    # k1 = old - ref = [[0.5, 0, -0.5], [1, 0, 8]] -> masked [[0.5, 0, -0.5], [1, 0, 0]]
    # rewards = scores - 0.1 * kl = [[-0.05, 0, 1.05], [-0.1, 2, 0]]
    # current kl: per-seq means 0/3 = 0 and 1/2 = 0.5 -> batch mean 0.25
    rewards, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, kl_ctrl=FixedKLController(0.1))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]]))
    assert math.isclose(metrics["actor/reward_kl_penalty"], 0.25, rel_tol=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_apply_kl_penalty_updates_adaptive_controller_with_batch_size():
    # kl 0.25 vs target 0.2: error 0.25 -> clipped 0.2; n_steps = B = 2 -> mult 1 + 0.2 * 2 / 100 = 1.004
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.2, horizon=100)
    _, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, kl_ctrl=ctrl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the beta used, before the update
    assert math.isclose(ctrl.value, 0.1 * 1.004, rel_tol=1e-6)


def test_apply_kl_penalty_uses_the_named_estimator():
    # abs: masked |kl| = [[0.5, 0, 0.5], [1, 0, 0]] -> seq means 1/3, 1/2 -> 5/12
    _, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, kl_ctrl=FixedKLController(0.1), kl_penalty="abs")
    assert math.isclose(metrics["actor/reward_kl_penalty"], 5 / 12, rel_tol=1e-6)
