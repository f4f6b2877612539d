"""The on-policy update without a separate old-log-prob pass: same weights, and the rollout diff from its forward."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
from rlhf_ops.trainer.metrics import ROLLOUT_DIFF_MAX, ROLLOUT_DIFF_MEAN
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from tests.unit.workers.test_dp_actor import _full_weights
from workers.actor import DataParallelPPOActor
from workers.fsdp import build_lr_scheduler, build_optimizer

ALGO = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.04, entropy_coeff=0.01)
ON_POLICY = {"mini_per_rank": 8, "micro_per_rank": 4, "num_mini_batches": 1, "ppo_epochs": 1}


def _actor(model: nn.Module, **plan: int) -> DataParallelPPOActor:
    optim = OptimConfig(lr=1e-3, eps=1e-4)
    opt = build_optimizer(model, optim)
    sched = build_lr_scheduler(opt, optim, total_steps=10)
    return DataParallelPPOActor(model, opt, sched, config=ActorConfig(), algorithm=ALGO, plan=make_plan(**plan))


def test_update_without_old_log_probs_equals_update_with_recomputed_ones(
    fsdp_model: Callable[..., nn.Module],
) -> None:
    data = make_ppo_batch()
    with_old = _actor(model_a := fsdp_model(), **ON_POLICY)
    old, _ = with_old.compute_log_prob(data)  # what the skipped pass would give
    data.batch["old_log_probs"] = old
    m_old = with_old.update_policy(data)

    skipped = make_ppo_batch()
    del skipped.batch["old_log_probs"]
    actor = _actor(model_b := fsdp_model(), **ON_POLICY)
    assert actor.on_policy
    m_new = actor.update_policy(skipped)
    # Same log-probs up to the micro-batch split (3 rows for the pass vs 4 in the update): the ratio is 1 and
    # the gradient adv * d log p in both, so the losses and the updated weights agree to fp32 rounding.
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert m_new[key] == pytest.approx(m_old[key], rel=1e-5, abs=1e-7), key
    assert m_new["actor/pg_clipfrac"] == 0.0 and m_new["actor/ppo_kl"] == 0.0
    w_old, w_new = _full_weights(model_a), _full_weights(model_b)
    for name in w_old:
        torch.testing.assert_close(w_new[name], w_old[name], rtol=1e-5, atol=1e-7, msg=name)
    assert ROLLOUT_DIFF_MAX not in m_new  # no rollout_log_probs in the batch: nothing to compare


def test_on_policy_update_reports_rollout_diff_of_its_first_forward(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch()
    model = fsdp_model()
    actor = _actor(model, **ON_POLICY)
    log_probs, _ = actor.compute_log_prob(data)
    mask = data.batch["response_mask"].bool()
    # rollout p = 1.5 * actor p on every token: |1.5p - p| = 0.5 p, so max = 0.5 max(p), mean = 0.5 mean(p).
    del data.batch["old_log_probs"]
    data.batch["rollout_log_probs"] = log_probs + math.log(1.5)
    metrics = actor.update_policy(data)
    p = log_probs.exp()[mask]
    assert metrics[ROLLOUT_DIFF_MAX] == pytest.approx(0.5 * p.max().item(), rel=1e-5)
    assert metrics[ROLLOUT_DIFF_MEAN] == pytest.approx(0.5 * p.mean().item(), rel=1e-5)


def test_off_policy_update_still_requires_old_log_probs(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch()
    del data.batch["old_log_probs"]
    actor = _actor(fsdp_model(), mini_per_rank=4, micro_per_rank=4, num_mini_batches=2)  # 2 optimizer steps
    assert not actor.on_policy
    with pytest.raises(ValueError, match="old_log_probs"):
        actor.update_policy(data)
