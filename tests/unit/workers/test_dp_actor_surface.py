"""DataParallelPPOActor on one gloo rank: KL early stop, truncated / rollout importance sampling, the loss variants."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlhf_ops.config.off_policy import RolloutCorrectionConfig
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
from rlhf_ops.protocol import DataProto
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.actor import DataParallelPPOActor
from workers.fsdp import build_lr_scheduler, build_optimizer


def _actor(model: nn.Module, algorithm: AlgorithmConfig, **plan_kwargs: int) -> DataParallelPPOActor:
    optim = OptimConfig(lr=1e-3, eps=1e-4)  # eps: see test_dp_actor.py
    opt = build_optimizer(model, optim)
    plan = make_plan(**plan_kwargs)
    return DataParallelPPOActor(
        model, opt, build_lr_scheduler(opt, optim, 10), config=ActorConfig(), algorithm=algorithm, plan=plan
    )


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _on_policy(actor: DataParallelPPOActor, data: DataProto) -> DataProto:
    """old_log_probs = the current weights' log-probs: ratio 1 at the first mini-batch."""
    old, _ = actor.compute_log_prob(data)
    data.batch["old_log_probs"] = old
    data.batch["rollout_log_probs"] = old.clone()
    return data


def test_kl_early_stop_fires_before_any_step_when_the_old_policy_is_far(fsdp_model: Callable[..., nn.Module]) -> None:
    # old = current + 1 per token: r = pi / pi_old = e^-1, k3 = r - 1 - log r = e^-1 - 1 + 1 = 0.368 > 1.5 x 0.1.
    model = fsdp_model()
    initial = _weights(model)
    actor = _actor(model, AlgorithmConfig(ppo_target_kl=0.1, ppo_epochs=3), mini_per_rank=4, ppo_epochs=3)
    data = _on_policy(actor, make_ppo_batch())
    data.batch["old_log_probs"] = data.batch["old_log_probs"] + 1.0
    metrics = actor.update_policy(data)
    assert metrics["actor/kl_early_stop"] == 1.0 and metrics["actor/trained_mini_batch_frac"] == 0.0
    assert metrics["actor/ppo_kl_k3"] == pytest.approx(torch.exp(torch.tensor(-1.0)).item(), rel=1e-4)
    assert "actor/grad_norm" not in metrics  # no optimizer step was taken
    for name, value in _weights(model).items():
        torch.testing.assert_close(value, initial[name], rtol=0, atol=0, msg=name)


def test_kl_early_stop_after_the_first_step_equals_training_that_mini_batch_only(
    fsdp_model: Callable[..., nn.Module],
) -> None:
    # 8 rows, mini-batches of 4, 3 epochs = 6 planned steps. The first mini-batch is on-policy (k3 = 0, not
    # above 1.5e-12); after its step the weights moved, so the second mini-batch's k3 > 0 stops the update.
    algorithm = AlgorithmConfig(ppo_target_kl=1e-12, ppo_epochs=3)
    model = fsdp_model()
    actor = _actor(model, algorithm, mini_per_rank=4, ppo_epochs=3)
    data = _on_policy(actor, make_ppo_batch())
    metrics = actor.update_policy(data)
    assert metrics["actor/kl_early_stop"] == 1.0
    assert metrics["actor/trained_mini_batch_frac"] == pytest.approx(1 / 6)
    # Reference: no early stop, one epoch over the first 4 rows only (the unshuffled first mini-batch).
    ref_model = fsdp_model()
    ref = _actor(ref_model, AlgorithmConfig(), mini_per_rank=4, num_mini_batches=1)
    ref.update_policy(data[list(range(4))])
    expected = _weights(ref_model)
    for name, value in _weights(model).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_kl_early_stop_with_a_large_target_never_fires(fsdp_model: Callable[..., nn.Module]) -> None:
    model = fsdp_model()
    actor = _actor(model, AlgorithmConfig(ppo_target_kl=10.0, ppo_epochs=2), mini_per_rank=4, ppo_epochs=2)
    metrics = actor.update_policy(_on_policy(actor, make_ppo_batch()))
    assert metrics["actor/kl_early_stop"] == 0.0 and metrics["actor/trained_mini_batch_frac"] == 1.0


def test_truncated_is_weights_scale_the_first_step_loss(fsdp_model: Callable[..., nn.Module]) -> None:
    # Ratio 1 at the first step: pg_loss = -sum(w * A * mask) / sum(mask). rollout = old - log 2 gives w = 2
    # (under the cap of 3) on every valid token: twice the plain loss.
    model = fsdp_model()
    actor = _actor(
        model, AlgorithmConfig(tis_imp_ratio_cap=3.0), mini_per_rank=8, micro_per_rank=3, num_mini_batches=1
    )
    data = _on_policy(actor, make_ppo_batch())
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] - torch.log(torch.tensor(2.0))
    metrics = actor.update_policy(data)
    adv, mask = data.batch["advantages"], data.batch["response_mask"].float()
    assert metrics["actor/pg_loss"] == pytest.approx(float(-2 * (adv * mask).sum() / mask.sum()), rel=1e-5)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(2.0, rel=1e-5)
    assert metrics["actor/tis_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="rollout_log_probs"):
        actor.update_policy(data.select([k for k in data.batch.keys() if k != "rollout_log_probs"]))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_weights_scale_the_first_step_loss(
    fsdp_model: Callable[..., nn.Module], level: str
) -> None:
    # verl's algorithm.rollout_correction, ratio 1 at the first step: pg_loss = -sum(w * A * mask) / sum(mask).
    # rollout = old - log 2 on every token: token level w = 2 (under the cap 3); sequence level w = min(2^L, 3)
    # for a row of L tokens (every row here holds 2+ tokens: the cap, 3x the plain loss).
    correction = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=3.0)  # type: ignore[arg-type]
    model = fsdp_model()
    algorithm = AlgorithmConfig(rollout_correction=correction)
    actor = _actor(model, algorithm, mini_per_rank=8, micro_per_rank=3, num_mini_batches=1)
    data = _on_policy(actor, make_ppo_batch())
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] - torch.log(torch.tensor(2.0))
    metrics = actor.update_policy(data)
    adv, mask = data.batch["advantages"], data.batch["response_mask"].float()
    lengths = mask.sum(-1, keepdim=True)
    w = torch.full_like(mask, 2.0) if level == "token" else torch.clamp(2.0**lengths, max=3.0).expand_as(mask)
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(w * adv * mask).sum() / mask.sum()), rel=1e-5)
    high = 0.0 if level == "token" else float(((lengths >= 2).float() * mask).sum() / mask.sum())
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(high, rel=1e-5)
    assert metrics["rollout_corr/kl"] == pytest.approx(-float(torch.log(torch.tensor(2.0))), rel=1e-5)


@pytest.mark.parametrize("policy_loss", ["cispo", "kl_cov", "clip_cov"])
def test_loss_variants_run_through_the_update(fsdp_model: Callable[..., nn.Module], policy_loss: str) -> None:
    # At ratio 1: CISPO's value is -A * 1 and KL-Cov's penalty |log r| is 0, so both give -mean(A) like PPO.
    # Clip-Cov drops the loss of a few tokens: with the share at 1 and bounds (-1e9, 1e9) every unclipped
    # token with cov in range is a candidate and all are dropped -> loss 0.
    algorithm = AlgorithmConfig(
        policy_loss=policy_loss,
        clip_cov_ratio=1.0,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,  # type: ignore[arg-type]
    )
    model = fsdp_model()
    actor = _actor(model, algorithm, mini_per_rank=8, micro_per_rank=8, num_mini_batches=1)
    data = _on_policy(actor, make_ppo_batch())
    metrics = actor.update_policy(data)
    adv, mask = data.batch["advantages"], data.batch["response_mask"].float()
    expected = 0.0 if policy_loss == "clip_cov" else float(-(adv * mask).sum() / mask.sum())
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    if policy_loss == "clip_cov":
        assert metrics["actor/cov_clipfrac"] == pytest.approx(1.0)
    else:
        assert metrics["actor/grad_norm"] > 0
