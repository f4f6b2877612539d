"""Every error path of the configuration, and the derived batch plan worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_ops.config import ConfigError, derive_batch_plan, dump_config, list_presets, load_config
from rlhf_ops.config.loader import apply_overrides, build_config, read_preset


def _problems(overrides: list[str], preset: str = "tiny-cpu") -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


@pytest.mark.parametrize("preset", ["tiny-cpu", "tiny-vlm-cpu", "qwen2.5-0.5b-grpo-gpu", "qwen2.5-7b-ppo-gpu"])
def test_shipped_presets_validate(preset: str) -> None:
    run = load_config(preset)
    assert preset in list_presets()
    assert run.world_size == run.resources.nnodes * run.resources.nproc_per_node


def test_dump_then_load_gives_equal_config(tmp_path) -> None:
    run = load_config("tiny-cpu", ["algorithm.kl_ctrl.kl_coef=0.02", "rollout.n=4"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(run))
    assert load_config(path) == run
    assert run.algorithm.kl_ctrl.kl_coef == 0.02 and run.rollout.n == 4


def test_override_values_are_typed_from_yaml() -> None:
    run = load_config("tiny-cpu", ["actor.optim.lr=1e-5", "trainer.val_before_train=false", "critic.model_path=null"])
    assert run.actor.optim.lr == pytest.approx(1e-5)
    assert run.trainer.val_before_train is False
    assert run.critic.model_path is None


def test_unknown_key_names_the_dotted_key_and_suggests_the_close_one() -> None:
    problems = _problems(["actor.optim.weight_decai=0.1"])
    assert "actor.optim.weight_decai" in problems
    assert "did you mean 'actor.optim.weight_decay'" in problems["actor.optim.weight_decai"]


def test_unknown_top_level_section() -> None:
    problems = _problems(["trainr.seed=3"])
    assert "did you mean 'trainer'" in problems["trainr"]


def test_wrong_type_and_out_of_range_are_all_reported_at_once() -> None:
    problems = _problems(["trainer.save_freq=often", "algorithm.clip_ratio_low=0", "algorithm.gamma=1.5"])
    assert set(problems) == {"trainer.save_freq", "algorithm.clip_ratio_low", "algorithm.gamma"}
    assert "type int" in problems["trainer.save_freq"]
    assert "set a value > 0.0" in problems["algorithm.clip_ratio_low"]
    assert "set a value <= 1.0" in problems["algorithm.gamma"]


def test_negative_clip_high_and_dual_clip_bound() -> None:
    problems = _problems(["algorithm.clip_ratio_high=-0.1", "algorithm.clip_ratio_c=1.0"])
    assert "set a value > 0.0" in problems["algorithm.clip_ratio_high"]
    assert "set a value > 1.0" in problems["algorithm.clip_ratio_c"]


def test_literal_lists_valid_choices() -> None:
    problems = _problems(["algorithm.adv_estimator=ppo"])
    assert "'gae'" in problems["algorithm.adv_estimator"] and "'grpo'" in problems["algorithm.adv_estimator"]


def test_missing_required_section_key() -> None:
    data = read_preset("tiny-cpu")
    del data["model"]["path"]
    with pytest.raises(ConfigError) as info:
        build_config(data)
    assert [p.key for p in info.value.problems] == ["model.path"]


def test_mini_batch_must_divide_train_batch() -> None:
    # 16 prompts per step cannot be cut into mini-batches of 3 prompts.
    problems = _problems(["actor.ppo_mini_batch_size=3"])
    assert "does not divide data.train_batch_size=16" in problems["actor.ppo_mini_batch_size"]


def test_mini_batch_sequences_must_split_over_dp_ranks() -> None:
    # 1 prompt x n=3 = 3 sequences over 2 ranks; 16 % 1 == 0 so only the dp rule fires.
    problems = _problems(["actor.ppo_mini_batch_size=1", "rollout.n=3"])
    assert "3 sequences do not split over 2 data-parallel ranks" in problems["actor.ppo_mini_batch_size"]


def test_micro_batch_must_divide_per_rank_mini_batch() -> None:
    # 8 prompts x 16 samples / 2 ranks = 64 per rank; 64 % 5 != 0.
    problems = _problems(["actor.ppo_micro_batch_size_per_gpu=5"])
    assert "does not divide the 64 sequences per rank" in problems["actor.ppo_micro_batch_size_per_gpu"]
    assert "use_dynamic_bsz" in problems["actor.ppo_micro_batch_size_per_gpu"]


def test_dynamic_bsz_skips_the_micro_batch_rule_but_checks_the_token_budget() -> None:
    load_config("tiny-cpu", ["actor.ppo_micro_batch_size_per_gpu=5", "actor.use_dynamic_bsz=true"])
    # max_prompt_length 16 + max_new_tokens 2 = 18 tokens: a budget of 10 cannot hold one sequence.
    problems = _problems(["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=10"])
    assert "set at least 18" in problems["actor.ppo_max_token_len_per_gpu"]


def test_group_estimator_needs_two_samples() -> None:
    problems = _problems(["rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=4"])
    assert "set rollout.n >= 2" in problems["rollout.n"]


def test_gae_with_one_sample_is_fine_and_checks_critic_sizes() -> None:
    load_config("tiny-cpu", ["algorithm.adv_estimator=gae", "rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=4"])
    problems = _problems(["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"])
    assert "critic.ppo_mini_batch_size" in problems


def test_kl_in_reward_and_in_loss_are_exclusive() -> None:
    problems = _problems(["algorithm.use_kl_in_reward=true"])  # the preset already has use_kl_loss
    assert "applied twice" in problems["algorithm.use_kl_loss"]


def test_no_reward_is_an_error() -> None:
    problems = _problems(["reward.reward_fn=null"])
    assert "reward.model_path" in problems["reward.reward_fn"]


def test_sequence_parallel_must_divide_world() -> None:
    problems = _problems(["actor.ulysses_sequence_parallel_size=3"])
    assert "set a divisor of 2" in problems["actor.ulysses_sequence_parallel_size"]


def test_sequence_parallel_needs_remove_padding() -> None:
    problems = _problems(["actor.ulysses_sequence_parallel_size=2"])
    assert "set actor.use_remove_padding=true" in problems["actor.use_remove_padding"]


def test_shared_prompts_refuse_ulysses_and_flash_attention() -> None:
    sp = ["actor.share_prompt_prefix=true", "actor.ulysses_sequence_parallel_size=2", "actor.use_remove_padding=true"]
    assert "actor.ulysses_sequence_parallel_size=1" in _problems(sp)["actor.share_prompt_prefix"]
    fa2 = _problems(["actor.share_prompt_prefix=true", "model.attn_implementation=flash_attention_2"])
    assert "set model.attn_implementation=sdpa" in fa2["actor.share_prompt_prefix"]
    assert load_config("tiny-cpu", ["actor.share_prompt_prefix=true"]).actor.share_prompt_prefix
    alone = _problems(["actor.share_prompt_attention=per_prompt", "model.attn_implementation=sdpa"])
    assert "set actor.share_prompt_prefix=true" in alone["actor.share_prompt_attention"]
    per_prompt = ["actor.share_prompt_prefix=true", "actor.share_prompt_attention=per_prompt"]
    eager = _problems([*per_prompt, "model.attn_implementation=eager"])
    assert "set model.attn_implementation=sdpa" in eager["actor.share_prompt_attention"]
    critic = _problems(
        ["algorithm.adv_estimator=gae", "critic.share_prompt_attention=per_prompt", "model.attn_implementation=sdpa"]
    )
    assert "set critic.share_prompt_prefix=true" in critic["critic.share_prompt_attention"]
    assert (
        load_config("tiny-cpu", [*per_prompt, "model.attn_implementation=sdpa"]).actor.share_prompt_attention
        == "per_prompt"
    )


def test_hsdp_replicate_must_divide_world() -> None:
    problems = _problems(["actor.fsdp.hsdp_replicate_size=3"])
    assert "actor.fsdp.hsdp_replicate_size" in problems


def test_vllm_on_cpu_needs_kv_cache_size() -> None:
    problems = _problems(["rollout.engine=vllm"])
    assert "rollout.kv_cache_memory_bytes" in problems
    load_config("tiny-cpu", ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=268435456"])


def test_async_rollout_mode_needs_the_vllm_engine() -> None:
    assert load_config("tiny-cpu").rollout.mode == "sync"  # the default: the sync path, unchanged
    problems = _problems(["rollout.mode=async"])  # tiny-cpu runs the HF engine
    assert problems["rollout.mode"] == (
        "async rollout runs a vLLM AsyncLLM engine, but rollout.engine=hf. Fix: set rollout.engine=vllm, or "
        "rollout.mode=sync"
    )
    overrides = ["rollout.mode=async", "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1048576"]
    cfg = load_config("tiny-cpu", overrides)
    assert cfg.rollout.mode == "async"
    with pytest.raises(ConfigError, match="rollout.mode"):
        load_config("tiny-cpu", ["rollout.mode=bogus"])


def test_tensor_parallel_rollout_needs_gpus() -> None:
    problems = _problems(["rollout.tensor_model_parallel_size=2"])
    assert "set 1 on CPU" in problems["rollout.tensor_model_parallel_size"]


def test_empty_resume_mode() -> None:
    assert "trainer.resume_mode" in _problems(["trainer.resume_mode=' '"])


def test_malformed_override_and_unknown_preset() -> None:
    assert "key=value" in str(_problems(["rollout.n"]))
    assert "unknown preset" in str(_problems([], preset="no-such-preset"))
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"rollout": {"n": 2}}, ["rollout.n.x=1"])


def test_batch_plan_of_tiny_cpu_by_hand() -> None:
    # 16 prompts x n=16 = 256 sequences per step on 2 ranks. Mini-batch 8 prompts = 128 sequences,
    # 64 per rank, micro 32 -> 2 accumulation steps; 16 / 8 = 2 optimizer steps per epoch.
    plan = derive_batch_plan(load_config("tiny-cpu"))
    assert plan.sequences_per_step == 256
    assert plan.max_seq_len == 16 + 2
    a = plan.actor
    assert (a.mini_batch_size, a.mini_batch_size_per_rank, a.micro_batch_size_per_rank) == (128, 64, 32)
    assert a.mini_batch_size_per_rank // a.micro_batch_size_per_rank == 2  # accumulation steps
    assert (a.num_mini_batches, a.mesh.dp_size) == (2, 2)
    assert plan.critic is None  # grpo has no critic


def test_batch_plan_with_sequence_parallel_and_hsdp() -> None:
    # 7B preset: 16 ranks, replicate 2 x shard 8; mini 128 prompts x n=1 over dp=16 -> 8 per rank.
    plan = derive_batch_plan(load_config("qwen2.5-7b-ppo-gpu"))
    assert (plan.actor.mesh.replicate_size, plan.actor.mesh.shard_size) == (2, 8)
    assert plan.actor.mini_batch_size_per_rank == 8
    assert plan.critic is not None and plan.critic.mini_batch_size_per_rank == 8
    sp_overrides = ["actor.ulysses_sequence_parallel_size=2", "actor.use_remove_padding=true"]
    sp = derive_batch_plan(load_config("tiny-cpu", sp_overrides))
    # dp = 2 / 2 = 1 -> all 128 sequences of a mini-batch on one dp rank; token budget doubles.
    assert (sp.actor.mesh.dp_size, sp.actor.mini_batch_size_per_rank) == (1, 128)
    assert sp.actor.max_token_len_per_rank == 2 * 16384


def test_cli_show_schema_and_error_exit_code() -> None:
    def rlhf(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rlhf_ops.cli", *args], capture_output=True, text=True)

    shown = rlhf("config", "show", "tiny-cpu", "rollout.n=4")
    assert shown.returncode == 0 and "n: 4" in shown.stdout
    schema = json.loads(rlhf("config", "schema").stdout)
    assert schema["properties"]["rollout"]["$ref"].endswith("RolloutConfig")
    assert schema["$defs"]["RolloutConfig"]["additionalProperties"] is False
    bad = rlhf("config", "show", "tiny-cpu", "rollout.n=0")
    assert bad.returncode == 2 and "rollout.n" in bad.stderr and "Fix:" in bad.stderr
