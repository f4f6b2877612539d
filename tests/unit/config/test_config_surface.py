"""Error paths of the training-surface keys: Liger, FSDP knobs, loss variants, KL early stop, dynamic sampling,
profiling (tiny-cpu: 2 CPU ranks, 16 prompts x n=16, mini-batches of 8 prompts)."""

from __future__ import annotations

import pytest

from rlhf_ops.config import ConfigError, derive_batch_plan, load_config


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


def test_liger_is_refused_on_cpu_with_the_fix() -> None:
    problems = _problems(["model.use_liger=true"])
    assert "Triton CUDA kernels" in problems["model.use_liger"]
    assert "set model.use_liger=false on CPU" in problems["model.use_liger"]
    assert load_config("tiny-cpu", ["model.use_liger=true", "resources.device=cuda"]).model.use_liger


def test_fsdp_size_must_divide_the_world_and_excludes_hsdp_replicate_size() -> None:
    assert "does not divide the world size 2" in _problems(["actor.fsdp.fsdp_size=3"])["actor.fsdp.fsdp_size"]
    assert "not -1" in _problems(["actor.fsdp.fsdp_size=0"])["actor.fsdp.fsdp_size"]
    both = _problems(["actor.fsdp.fsdp_size=1", "actor.fsdp.hsdp_replicate_size=2"])
    assert "set one of them" in both["actor.fsdp.fsdp_size"]
    assert "ref.fsdp.fsdp_size" in _problems(["ref.fsdp.fsdp_size=5"])


def test_fsdp_size_sets_the_hsdp_mesh_of_the_plan() -> None:
    # 2 ranks, shard groups of 1 -> 2 replicas of 1 shard each (the same mesh as hsdp_replicate_size=2).
    mesh = derive_batch_plan(load_config("tiny-cpu", ["actor.fsdp.fsdp_size=1"])).actor.mesh
    assert (mesh.replicate_size, mesh.shard_size) == (2, 1)
    mesh = derive_batch_plan(load_config("tiny-cpu", ["actor.fsdp.fsdp_size=-1"])).actor.mesh
    assert (mesh.replicate_size, mesh.shard_size) == (1, 2)


def test_wrap_policy_by_class_or_by_size_not_both() -> None:
    problems = _problems(
        ["actor.fsdp.wrap_policy.min_num_params=1000", "actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap=[X]"]
    )
    assert "not both" in problems["actor.fsdp.wrap_policy"]
    problems = _problems(["actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap=[]"])
    assert "only the root" in problems["actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap"]


def test_clip_cov_bounds_must_leave_a_range() -> None:
    problems = _problems(["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_lb=5", "algorithm.clip_cov_ub=1"])
    assert "no token can be selected" in problems["algorithm.clip_cov_lb"]
    assert load_config("tiny-cpu", ["algorithm.policy_loss=kl_cov", "algorithm.kl_cov_ratio=0.002"])


def test_tis_needs_untransformed_sampling() -> None:
    problems = _problems(["algorithm.tis_imp_ratio_cap=2", "rollout.temperature=0.7", "rollout.top_k=20"])
    assert "top_k=-1" in problems["algorithm.tis_imp_ratio_cap"]
    assert load_config(
        "tiny-cpu", ["algorithm.tis_imp_ratio_cap=2", "rollout.temperature=0.7"]
    ).algorithm.tis_imp_ratio_cap
    assert load_config("tiny-cpu", ["algorithm.tis_imp_ratio_cap=2"]).algorithm.tis_imp_ratio_cap == 2.0


def test_kl_early_stop_that_can_never_fire_is_refused() -> None:
    # One epoch, one mini-batch of all 16 prompts: the only KL measured is before any update.
    problems = _problems(["algorithm.ppo_target_kl=0.01", "actor.ppo_mini_batch_size=16"])
    assert "never fires" in problems["algorithm.ppo_target_kl"]
    assert load_config("tiny-cpu", ["algorithm.ppo_target_kl=0.01"]).algorithm.ppo_target_kl == 0.01


def test_dynamic_sampling_needs_groups() -> None:
    problems = _problems(
        ["algorithm.filter_groups.enable=true", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"]
    )
    assert "groups of one" in problems["algorithm.filter_groups.enable"]


def test_profile_steps_are_training_steps() -> None:
    assert "list steps >= 1" in _problems(["trainer.profile_steps=[0,3]"])["trainer.profile_steps"]
    assert load_config("tiny-cpu", ["trainer.profile_steps=[2]"]).trainer.profile_steps == [2]
