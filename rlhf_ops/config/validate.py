"""Cross-field rules of :class:`RunConfig` that a single field cannot express.

Each rule appends a :class:`ConfigProblem`; :func:`check_config` raises once with all of them.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from rlhf_ops.config.errors import ConfigError, ConfigProblem
from rlhf_ops.config.schema import ActorConfig, CriticConfig, RunConfig

# URL schemes a checkpoint can be read from (rlhf_ops.storage.SUPPORTED_SCHEMES; not imported: config stays
# free of the storage stack, a test keeps the two equal).
CHECKPOINT_SCHEMES = ("file", "s3", "hdfs", "webhdfs")
RESUME_KEYWORDS = ("auto", "disable")

# Estimators that normalise within the group of samples of one prompt (need n >= 2).
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})


def _micro_does_not_divide(per_rank: int, micro: int) -> bool:
    # A micro-batch larger than the per-rank mini-batch is clamped to it (one micro-batch).
    return micro < per_rank and per_rank % micro != 0


def _check_ppo_sizes(
    section: str, cfg: ActorConfig | CriticConfig, run: RunConfig, problems: list[ConfigProblem]
) -> None:
    n, world = run.rollout.n, run.world_size
    sp = cfg.ulysses_sequence_parallel_size
    if world % sp:
        problems.append(
            ConfigProblem(
                f"{section}.ulysses_sequence_parallel_size",
                f"{sp} does not divide the world size {world}",
                f"set a divisor of {world}",
            )
        )
        return
    if sp > 1 and not cfg.use_remove_padding:
        problems.append(
            ConfigProblem(
                f"{section}.use_remove_padding",
                f"Ulysses sequence parallel ({section}.ulysses_sequence_parallel_size={sp}) shards packed sequences",
                f"set {section}.use_remove_padding=true",
            )
        )
    dp = world // sp
    bsz = run.data.train_batch_size
    if bsz % cfg.ppo_mini_batch_size:
        problems.append(
            ConfigProblem(
                f"{section}.ppo_mini_batch_size",
                f"{cfg.ppo_mini_batch_size} does not divide data.train_batch_size={bsz}",
                f"set a divisor of {bsz}",
            )
        )
    mini_seqs = cfg.ppo_mini_batch_size * n
    if mini_seqs % dp:
        problems.append(
            ConfigProblem(
                f"{section}.ppo_mini_batch_size",
                f"{cfg.ppo_mini_batch_size} prompts x rollout.n={n} = {mini_seqs} sequences do not split over "
                f"{dp} data-parallel ranks",
                f"make ppo_mini_batch_size * rollout.n a multiple of {dp}",
            )
        )
    elif not cfg.use_dynamic_bsz and _micro_does_not_divide(mini_seqs // dp, cfg.ppo_micro_batch_size_per_gpu):
        per_rank = mini_seqs // dp
        problems.append(
            ConfigProblem(
                f"{section}.ppo_micro_batch_size_per_gpu",
                f"{cfg.ppo_micro_batch_size_per_gpu} does not divide the {per_rank} sequences per rank of a "
                f"mini-batch (ppo_mini_batch_size x rollout.n / dp = {mini_seqs} / {dp})",
                f"set a divisor of {per_rank}, or turn on {section}.use_dynamic_bsz",
            )
        )
    max_len = run.data.max_prompt_length + run.rollout.max_new_tokens
    if cfg.use_dynamic_bsz and cfg.ppo_max_token_len_per_gpu < max_len:
        problems.append(
            ConfigProblem(
                f"{section}.ppo_max_token_len_per_gpu",
                f"{cfg.ppo_max_token_len_per_gpu} is below one full sequence "
                f"(max_prompt_length + max_new_tokens = {max_len})",
                f"set at least {max_len}",
            )
        )
    if world % cfg.fsdp.hsdp_replicate_size:
        problems.append(
            ConfigProblem(
                f"{section}.fsdp.hsdp_replicate_size",
                f"{cfg.fsdp.hsdp_replicate_size} does not divide the world size {world}",
                f"set a divisor of {world} (e.g. the number of nodes)",
            )
        )


def _check_gpu_share(run: RunConfig, problems: list[ConfigProblem]) -> None:
    share = run.resources.gpus_per_worker
    if share >= 1.0:
        return
    if run.resources.device != "cuda":
        problems.append(
            ConfigProblem(
                "resources.gpus_per_worker",
                f"{share} shares GPUs between ranks, but resources.device={run.resources.device}",
                "set resources.device=cuda, or leave resources.gpus_per_worker at 1",
            )
        )
    if run.rollout.tensor_model_parallel_size > 1:
        problems.append(
            ConfigProblem(
                "rollout.tensor_model_parallel_size",
                f"{run.rollout.tensor_model_parallel_size} needs one GPU per TP rank (NCCL refuses two ranks on one "
                f"device), but resources.gpus_per_worker={share} puts ranks on a shared GPU",
                "set rollout.tensor_model_parallel_size=1, or resources.gpus_per_worker=1",
            )
        )


def _check_algorithm(run: RunConfig, problems: list[ConfigProblem]) -> None:
    algo = run.algorithm
    if algo.adv_estimator in GROUP_ESTIMATORS and run.rollout.n < 2:
        problems.append(
            ConfigProblem(
                "rollout.n",
                f"{run.rollout.n} sample(s) per prompt, but algorithm.adv_estimator={algo.adv_estimator} "
                "normalises within the group of samples of a prompt",
                "set rollout.n >= 2 (4-16 is typical)",
            )
        )
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
        parts = urlsplit(mode)
        if parts.scheme.lower() not in CHECKPOINT_SCHEMES or not (parts.netloc or parts.path.strip("/")):
            return ConfigProblem("trainer.resume_mode", f"{mode!r} is not a checkpoint URL of a known scheme", fix)
        if parts.scheme.lower() == "file" and not Path(parts.path).exists():
            return ConfigProblem("trainer.resume_mode", f"{mode!r} does not exist", fix)
        return None
    if not Path(mode).exists():
        return ConfigProblem(
            "trainer.resume_mode", f"{mode!r} is neither 'auto', 'disable', a URL nor an existing path", fix
        )
    return None


def _check_rest(run: RunConfig, problems: list[ConfigProblem]) -> None:
    if run.reward.model_path is None and run.reward.reward_fn is None:
        problems.append(
            ConfigProblem(
                "reward.reward_fn",
                "no reward: neither reward.model_path nor reward.reward_fn is set",
                "set reward.reward_fn (a built-in name or 'pkg.module:function') and/or reward.model_path",
            )
        )
    if run.resources.device == "cpu" and run.rollout.engine == "vllm" and run.rollout.kv_cache_memory_bytes is None:
        problems.append(
            ConfigProblem(
                "rollout.kv_cache_memory_bytes",
                "vLLM on CPU needs an explicit, small KV cache size",
                "set e.g. rollout.kv_cache_memory_bytes=268435456",
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


def collect_problems(run: RunConfig) -> list[ConfigProblem]:
    """Every cross-field problem of ``run`` (empty when consistent)."""
    problems: list[ConfigProblem] = []
    _check_ppo_sizes("actor", run.actor, run, problems)
    if run.needs_critic:
        _check_ppo_sizes("critic", run.critic, run, problems)
    _check_gpu_share(run, problems)
    _check_algorithm(run, problems)
    _check_rest(run, problems)
    _check_reward(run, problems)
    return problems


def check_config(run: RunConfig) -> RunConfig:
    """Returns ``run`` unchanged, or raises :class:`ConfigError` listing every problem."""
    problems = collect_problems(run)
    if problems:
        raise ConfigError(problems)
    return run
