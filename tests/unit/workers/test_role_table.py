"""The launcher's role table: which worker groups a config starts, with which sections of the config."""

from __future__ import annotations

from rlhf_ops.config import derive_batch_plan, load_config
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.critic.critic_worker import CriticWorker
from workers.launcher import role_table
from workers.reward_model.reward_model_worker import RewardModelWorker
from workers.single_controller.decorator import Dispatch, get_dispatch_spec


def _rows(overrides: list[str]) -> list[tuple[str, type, object]]:
    config = load_config("tiny-cpu", overrides)
    plan = derive_batch_plan(config, steps_per_epoch=4)
    rows = role_table(
        config, plan, model_path="/m", pad_token_id=0, eos_token_id=(2,), profile_steps=(), profile_dir="/p"
    )
    return [(name, cls, spec) for name, cls, spec in rows]


def test_grpo_with_a_kl_loss_starts_only_the_actor_rollout_ref_group() -> None:
    [(name, cls, spec)] = _rows([])
    assert (name, cls) == ("actor_rollout_ref", ActorRolloutRefWorker)
    assert spec.plan.actor.optimizer_steps == 8 * 2  # type: ignore[attr-defined]  # 4 x 2 epochs, 2 mini-batches


def test_ppo_with_a_reward_model_starts_three_groups_and_the_rm_has_its_own_fsdp_section() -> None:
    overrides = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        "reward.model_path=/rm",
        "reward.fsdp.reshard_after_forward=false",
    ]
    rows = _rows(overrides)
    assert [(name, cls) for name, cls, _ in rows] == [
        ("actor_rollout", ActorRolloutRefWorker),  # no KL anywhere: no reference part
        ("critic", CriticWorker),
        ("reward_model", RewardModelWorker),
    ]
    rm = rows[2][2]
    assert rm.fsdp.reshard_after_forward is False  # type: ignore[attr-defined]
    assert load_config("tiny-cpu", overrides).ref.fsdp.reshard_after_forward is True  # not borrowed from ref


def test_async_rollout_mode_is_the_same_worker_with_the_engine_s_async_mode() -> None:
    [(name, cls, spec)] = _rows(["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1048576", "rollout.mode=async"])
    assert (name, cls) == ("actor_rollout_ref", ActorRolloutRefWorker) and spec.rollout.mode == "async"  # type: ignore[attr-defined]
    [(_, sync_cls, sync_spec)] = _rows(["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1048576"])
    assert sync_cls is ActorRolloutRefWorker and sync_spec.rollout.mode == "sync"  # type: ignore[attr-defined]
    # The one-step-off methods are the worker's own (a part, not a subclass), dispatched per data-parallel chunk.
    for method in (ActorRolloutRefWorker.submit_sequences, ActorRolloutRefWorker.collect_sequences):
        dispatch = get_dispatch_spec(method)
        assert dispatch is not None and dispatch.mode is Dispatch.DP_COMPUTE_PROTO


def test_a_registered_user_role_is_started_after_the_built_ins() -> None:
    from tests.support.extension_role import ROLE, ResponseLengthWorker
    from workers.roles import WORKER_ROLES

    WORKER_ROLES.register(ROLE)
    try:
        rows = _rows(["algorithm.gamma=0.5"])
    finally:
        WORKER_ROLES.unregister(ROLE.name)
    assert [(name, cls) for name, cls, _ in rows] == [
        ("actor_rollout_ref", ActorRolloutRefWorker),
        ("length_scorer", ResponseLengthWorker),
    ]
    assert rows[1][2].scale == 0.5  # type: ignore[attr-defined]  # its spec, from its own builder


def test_a_role_whose_worker_lacks_a_dispatch_method_is_refused_in_one_line() -> None:
    import dataclasses

    import pytest

    from tests.support.extension_role import ROLE
    from workers.roles import WORKER_ROLES

    broken = dataclasses.replace(ROLE, name="broken_scorer", methods=("init_model", "score_everything"))
    WORKER_ROLES.register(broken)
    try:
        with pytest.raises(ValueError, match=r"'broken_scorer': ResponseLengthWorker registers no dispatch method "):
            _rows([])
    finally:
        WORKER_ROLES.unregister(broken.name)
