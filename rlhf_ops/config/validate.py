"""Cross-field rules of :class:`RunConfig` that a single field cannot express, collected in one place.

The rules are grouped by the feature they guard, one module each: batch sizes and meshes (``batch_rules``), FSDP
(``fsdp_rules``), vision-language policies (``vision_rules``), the extension tables (``extension_rules``),
off-policy and async training (``off_policy_rules``, ``async_rules``), checkpoints, LoRA, reproducibility,
multi-turn. What is left here: the algorithm, paths, the reward and the remaining knobs.
Each rule appends a :class:`ConfigProblem`; :func:`check_config` raises once with all of them.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from rlhf_ops.config.batch_plan import is_on_policy
from rlhf_ops.config.batch_rules import batch_size_problems
from rlhf_ops.config.checkpoint_rules import checkpoint_problems
from rlhf_ops.config.errors import ConfigError, ConfigProblem, shown_value

# GROUP_ESTIMATORS: re-exported for callers that read it here (the table is the source).
from rlhf_ops.config.extension_rules import GROUP_ESTIMATORS as GROUP_ESTIMATORS
from rlhf_ops.config.extension_rules import extension_problems
from rlhf_ops.config.fsdp_rules import fsdp_problems
from rlhf_ops.config.lora_rules import lora_problems
from rlhf_ops.config.multi_turn import multi_turn_problems
from rlhf_ops.config.off_policy_rules import off_policy_problems
from rlhf_ops.config.reproducibility_rules import reproducibility_problems
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.config.section import CPU_KV_BLOCK_SIZE
from rlhf_ops.config.vision_rules import vision_language_problems
from rlhf_ops.fs_protocols import unknown_protocol_problem
from rlhf_ops.sampling import rollout_logprobs_comparable

RESUME_KEYWORDS = ("auto", "disable")


def _check_algorithm(run: RunConfig, problems: list[ConfigProblem]) -> None:
    algo = run.algorithm
    if algo.use_kl_in_reward and algo.use_kl_loss:
        problems.append(
            ConfigProblem(
                "algorithm.use_kl_loss",
                "KL is both in the reward (use_kl_in_reward) and in the loss; it would be applied twice",
                "set one of algorithm.use_kl_in_reward / algorithm.use_kl_loss to false",
            )
        )


def _resume_mode_problem(mode: str) -> ConfigProblem | None:
    """``auto``, ``disable``, a URL of a known scheme, or a local path that exists (else a typo resumes nothing)."""
    fix = "set 'auto', 'disable', an existing global_step_<N> folder or a file://, s3://, hdfs://, webhdfs:// URL"
    if not mode.strip():
        return ConfigProblem("trainer.resume_mode", "empty", fix)
    if mode in RESUME_KEYWORDS:
        return None
    if "://" in mode:
        try:
            parts = urlsplit(mode)
        except ValueError as exc:  # e.g. an unclosed '[' of an IPv6 host
            return ConfigProblem("trainer.resume_mode", f"{shown_value(mode)} is not a valid URL ({exc})", fix)
        # Any protocol fsspec knows (its implementation is imported where the checkpoint is read, not here).
        if unknown_protocol_problem(parts.scheme.lower()) or not (parts.netloc or parts.path.strip("/")):
            return ConfigProblem(
                "trainer.resume_mode", f"{shown_value(mode)} is not a checkpoint URL of a known scheme", fix
            )
        if parts.scheme.lower() == "file" and not _exists(parts.path):
            return ConfigProblem("trainer.resume_mode", f"{shown_value(mode)} does not exist", fix)
        return None
    if not _exists(mode):
        return ConfigProblem(
            "trainer.resume_mode", f"{shown_value(mode)} is neither 'auto', 'disable', a URL nor an existing path", fix
        )
    return None


def _exists(path: str) -> bool:
    """``Path(path).exists()``, False for a name the OS refuses (too long, NUL): a typo, not a crash."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _check_rest(run: RunConfig, problems: list[ConfigProblem]) -> None:
    if run.reward.model_path is None and run.reward.reward_fn is None:
        problems.append(
            ConfigProblem(
                "reward.reward_fn",
                "no reward: neither reward.model_path nor reward.reward_fn is set",
                "set reward.reward_fn (a built-in name or 'pkg.module:function') and/or reward.model_path",
            )
        )
    resume = _resume_mode_problem(run.trainer.resume_mode)
    if resume is not None:
        problems.append(resume)
    tp = run.rollout.tensor_model_parallel_size
    if run.world_size % tp:
        problems.append(
            ConfigProblem(
                "rollout.tensor_model_parallel_size",
                f"{tp} does not divide the world size {run.world_size}",
                f"set a divisor of {run.world_size}",
            )
        )
    if run.resources.device == "cpu" and tp > 1:
        problems.append(
            ConfigProblem("rollout.tensor_model_parallel_size", "tensor parallel rollout needs GPUs", "set 1 on CPU")
        )
    block = run.rollout.kv_block_size
    if run.resources.device == "cpu" and block is not None and block % CPU_KV_BLOCK_SIZE:
        problems.append(
            ConfigProblem(
                "rollout.kv_block_size",
                f"{block}: vLLM's CPU attention takes KV blocks in multiples of {CPU_KV_BLOCK_SIZE} tokens",
                f"set {CPU_KV_BLOCK_SIZE} (or leave it unset)",
            )
        )


def _check_reward(run: RunConfig, problems: list[ConfigProblem]) -> None:
    overlong, max_len = run.reward.overlong_buffer, run.rollout.max_new_tokens
    if not overlong.enable:
        return
    if run.reward.reward_fn is None:
        problems.append(
            ConfigProblem(
                "reward.overlong_buffer.enable",
                "the overlong penalty is added to the rule reward, but reward.reward_fn is not set",
                "set reward.reward_fn, or reward.overlong_buffer.enable=false",
            )
        )
    if not 0 < overlong.len <= max_len:
        problems.append(
            ConfigProblem(
                "reward.overlong_buffer.len",
                f"{overlong.len} is not in 1..rollout.max_new_tokens={max_len}",
                f"set a buffer of 1..{max_len} tokens (DAPO: a quarter of the budget, e.g. {max(1, max_len // 4)})",
            )
        )


def _check_surface(run: RunConfig, problems: list[ConfigProblem]) -> None:
    """Liger, FSDP knobs, loss variants, KL early stop, dynamic sampling, profiling."""
    algo, rollout = run.algorithm, run.rollout
    if run.model.use_liger and run.resources.device == "cpu":
        problems.append(
            ConfigProblem(
                "model.use_liger",
                "liger-kernel's fused kernels are Triton CUDA kernels; they cannot run with resources.device=cpu",
                "set model.use_liger=false on CPU (or resources.device=cuda on the GPU image)",
            )
        )
    problems.extend(fsdp_problems(run))
    if algo.policy_loss == "clip_cov" and algo.clip_cov_lb >= algo.clip_cov_ub:
        problems.append(
            ConfigProblem(
                "algorithm.clip_cov_lb",
                f"{algo.clip_cov_lb} is not below algorithm.clip_cov_ub={algo.clip_cov_ub}: no token can be selected",
                "set clip_cov_lb < clip_cov_ub (the paper uses 1 and 5)",
            )
        )
    if algo.tis_imp_ratio_cap is not None and not rollout_logprobs_comparable(
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
    ):
        problems.append(
            ConfigProblem(
                "algorithm.tis_imp_ratio_cap",
                f"top_k / top_p truncate the sampled distribution (top_k={rollout.top_k}, top_p={rollout.top_p}) "
                f"at temperature {rollout.temperature}: the actor cannot recompute it, so the weight would measure "
                "the truncation, not the engine mismatch",
                "sample with rollout.top_k=-1 and top_p=1.0 (any temperature), or at temperature 1.0, "
                "or unset algorithm.tis_imp_ratio_cap",
            )
        )
    single_pass = is_on_policy(algo.ppo_epochs, run.data.train_batch_size // run.actor.ppo_mini_batch_size)
    if algo.ppo_target_kl is not None and single_pass:
        problems.append(
            ConfigProblem(
                "algorithm.ppo_target_kl",
                "one PPO epoch of one mini-batch: its KL is measured before any update (0), so early stop never fires",
                "raise algorithm.ppo_epochs or lower actor.ppo_mini_batch_size, or unset algorithm.ppo_target_kl",
            )
        )
    if algo.filter_groups.enable and rollout.n < 2:
        problems.append(
            ConfigProblem(
                "algorithm.filter_groups.enable",
                f"dynamic sampling drops groups of equal rewards, but rollout.n={rollout.n} gives groups of one",
                "set rollout.n >= 2, or algorithm.filter_groups.enable=false",
            )
        )
    bad_steps = [s for s in run.trainer.profile_steps if s < 1]
    if bad_steps:
        problems.append(
            ConfigProblem("trainer.profile_steps", f"{bad_steps} are not training steps", "list steps >= 1")
        )


def collect_problems(run: RunConfig) -> list[ConfigProblem]:
    """Every cross-field problem of ``run`` (empty when consistent)."""
    problems: list[ConfigProblem] = []
    problems.extend(batch_size_problems(run))
    _check_algorithm(run, problems)
    _check_rest(run, problems)
    problems.extend(vision_language_problems(run))
    _check_reward(run, problems)
    _check_surface(run, problems)
    problems.extend(extension_problems(run))
    problems.extend(off_policy_problems(run))
    problems.extend(checkpoint_problems(run.trainer))
    problems.extend(lora_problems(run))
    problems.extend(reproducibility_problems(run))
    problems.extend(
        multi_turn_problems(
            run.rollout.multi_turn,
            max_new_tokens=run.rollout.max_new_tokens,
            apply_chat_template=run.data.apply_chat_template,
            tensor_parallel_size=run.rollout.tensor_model_parallel_size,
        )
    )
    return problems


def check_config(run: RunConfig) -> RunConfig:
    """Returns ``run`` unchanged, or raises :class:`ConfigError` listing every problem."""
    problems = collect_problems(run)
    if problems:
        raise ConfigError(problems)
    return run
