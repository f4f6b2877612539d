"""The plan's derived counts (issue 10): one place for total steps, optimizer steps and per-role budgets."""

from __future__ import annotations

import pytest

from rlhf_ops.config import derive_batch_plan, load_config, total_training_steps
from rlhf_ops.config.batch_plan import require_optimizer_steps
from rlhf_ops.pipeline.preflight import plan_checkpoints

SP = ["actor.ulysses_sequence_parallel_size=2", "actor.use_remove_padding=true", "actor.use_dynamic_bsz=true"]


def test_the_reference_budget_carries_the_actors_sp_factor() -> None:
    # The reference runs on the actor's ranks: under Ulysses (sp=2) an SP group forwards one micro-batch
    # together, each rank half of it, so both budgets are the per-GPU figure x 2 (it once stayed x 1).
    budgets = ["actor.log_prob_max_token_len_per_gpu=1000", "ref.log_prob_max_token_len_per_gpu=1000"]
    plan = derive_batch_plan(load_config("tiny-cpu", [*SP, *budgets, "ref.log_prob_micro_batch_size_per_gpu=5"]))
    assert plan.actor.log_prob.max_token_len_per_rank == 2000
    assert plan.ref.max_token_len_per_rank == 2000
    assert (plan.ref.micro_batch_size_per_rank, plan.ref.use_dynamic_bsz) == (5, True)
    no_sp = derive_batch_plan(load_config("tiny-cpu", budgets))
    assert no_sp.ref.max_token_len_per_rank == no_sp.actor.log_prob.max_token_len_per_rank == 1000


def test_total_and_optimizer_steps_come_from_the_plan() -> None:
    # tiny-cpu + GAE: 16 prompts per step in mini-batches of 8 -> 2 optimizer steps per epoch of PPO, 1 epoch.
    config = load_config("tiny-cpu", ["algorithm.adv_estimator=gae", "trainer.total_training_steps=100"])
    plan = derive_batch_plan(config, steps_per_epoch=64)  # 2 epochs x 64 = 128, capped at 100
    assert (plan.steps_per_epoch, plan.total_steps) == (64, 100)
    assert plan.critic is not None
    assert plan.actor.optimizer_steps == plan.critic.optimizer_steps == 100 * 2 * 1
    uncapped = derive_batch_plan(
        config.model_copy(update={"trainer": config.trainer.model_copy(update={"total_training_steps": None})}),
        steps_per_epoch=3,
    )
    assert uncapped.total_steps == 6 and uncapped.actor.optimizer_steps == 12
    # The pre-flight's checkpoint plan uses the same rule: 1024 toy rows / 16 = 64 steps per epoch.
    assert (
        plan_checkpoints(config, num_train=1024)[0]
        == plan.total_steps
        == total_training_steps(config.trainer, steps_per_epoch=64)
    )


def test_a_plan_without_the_training_sets_size_is_refused_by_a_trained_role() -> None:
    plan = derive_batch_plan(load_config("tiny-cpu"))
    assert plan.total_steps is None and plan.actor.optimizer_steps is None
    with pytest.raises(ValueError, match=r"derive_batch_plan\(config, steps_per_epoch=len\(train_loader\)\)"):
        require_optimizer_steps(plan.actor, role="actor")
