"""Cross-field rules of :class:`RunConfig` that a single field cannot express.

Each rule appends a :class:`ConfigProblem`; :func:`check_config` raises once with all of them.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from rlhf_ops.config.batch_plan import is_on_policy
from rlhf_ops.config.checkpoint_rules import checkpoint_problems
from rlhf_ops.config.errors import ConfigError, ConfigProblem, shown_value

# GROUP_ESTIMATORS: re-exported for callers that read it here (the table is the source).
from rlhf_ops.config.extension_rules import GROUP_ESTIMATORS as GROUP_ESTIMATORS
from rlhf_ops.config.extension_rules import extension_problems
from rlhf_ops.config.lora_rules import lora_problems
from rlhf_ops.config.multi_turn import multi_turn_problems
from rlhf_ops.config.off_policy_rules import off_policy_problems
from rlhf_ops.config.schema import ActorConfig, CriticConfig, FSDPConfig, RunConfig
from rlhf_ops.extensions import ROLLOUT_ENGINES
from rlhf_ops.fs_protocols import unknown_protocol_problem
from rlhf_ops.sampling import rollout_logprobs_comparable

RESUME_KEYWORDS = ("auto", "disable")


def _micro_does_not_divide(per_rank: int, micro: int) -> bool:
    # A micro-batch larger than the per-rank mini-batch is clamped to it (one micro-batch).
    return micro < per_rank and per_rank % micro != 0


def _check_shared_prompts(
    section: str, cfg: ActorConfig | CriticConfig, run: RunConfig, problems: list[ConfigProblem]
) -> None:
    """``<section>.share_prompt_prefix`` packs rows into one sequence with an explicit attention mask."""
    key = f"{section}.share_prompt_prefix"
    if cfg.ulysses_sequence_parallel_size > 1:
        problems.append(
            ConfigProblem(
                key,
                "Ulysses shards a packed row by position, which a shared prompt's mask does not allow",
                f"set {key}=false or {section}.ulysses_sequence_parallel_size=1",
            )
        )
    if run.model.attn_implementation == "flash_attention_2":
        problems.append(
            ConfigProblem(
                key,
                "FlashAttention takes no explicit attention mask, which shared prompts need",
                f"set model.attn_implementation=sdpa, or {key}=false (use remove padding instead)",
            )
        )


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
    if cfg.share_prompt_prefix:
        _check_shared_prompts(section, cfg, run, problems)
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


# fsdp keys that are the trained roles' only. The frozen roles have no optimizer and run no backward; the
# reference also shards on the actor's mesh (the reward model has its own mesh keys in reward.fsdp).
_FROZEN_FSDP_NO_EFFECT = {
    "ref": {
        "optimizer_offload": "the reference has no optimizer",
        "activation_checkpointing": "the reference runs no backward (nothing to recompute)",
        "hsdp_replicate_size": "the reference shards on the actor's mesh (set actor.fsdp.hsdp_replicate_size)",
        "fsdp_size": "the reference shards on the actor's mesh (set actor.fsdp.fsdp_size)",
    },
    "reward": {
        "optimizer_offload": "the reward model has no optimizer",
        "activation_checkpointing": "the reward model runs no backward (nothing to recompute)",
    },
}


def _check_frozen_fsdp(role: str, fsdp: FSDPConfig, problems: list[ConfigProblem]) -> None:
    """A ``ref.fsdp`` / ``reward.fsdp`` key that would be silently ignored is an error, not a no-op."""
    defaults = FSDPConfig()
    for key, why in _FROZEN_FSDP_NO_EFFECT[role].items():
        if getattr(fsdp, key) != getattr(defaults, key):
            problems.append(ConfigProblem(f"{role}.fsdp.{key}", f"has no effect: {why}", f"remove {role}.fsdp.{key}"))


def _check_fsdp_knobs(section: str, fsdp: FSDPConfig, world: int, problems: list[ConfigProblem]) -> None:
    if fsdp.fsdp_size != -1:
        if fsdp.fsdp_size < 1 or world % fsdp.fsdp_size:
            problems.append(
                ConfigProblem(
                    f"{section}.fsdp.fsdp_size",
                    f"{fsdp.fsdp_size} is not -1 and does not divide the world size {world}",
                    f"set -1 (shard over all ranks) or a divisor of {world} (e.g. the GPUs of one node)",
                )
            )
        elif fsdp.hsdp_replicate_size != 1:
            problems.append(
                ConfigProblem(
                    f"{section}.fsdp.fsdp_size",
                    f"both fsdp_size={fsdp.fsdp_size} and hsdp_replicate_size={fsdp.hsdp_replicate_size} set the "
                    "same mesh",
                    "set one of them: fsdp_size (shard-group size) or hsdp_replicate_size (replica groups)",
                )
            )
    policy = fsdp.wrap_policy
    if policy.min_num_params > 0 and policy.transformer_layer_cls_to_wrap is not None:
        problems.append(
            ConfigProblem(
                f"{section}.fsdp.wrap_policy",
                "both transformer_layer_cls_to_wrap and min_num_params are set",
                "wrap by class list or by parameter count, not both (unset one)",
            )
        )
    if policy.transformer_layer_cls_to_wrap is not None and not policy.transformer_layer_cls_to_wrap:
        problems.append(
            ConfigProblem(
                f"{section}.fsdp.wrap_policy.transformer_layer_cls_to_wrap",
                "empty list: only the root would be sharded",
                "name the decoder block class (e.g. ['LlamaDecoderLayer']) or leave it unset",
            )
        )


def _check_vision_language(run: RunConfig, problems: list[ConfigProblem]) -> None:
    """What a vision-language policy (``model.modality``, or detected from config.json) cannot use yet."""
    from rlhf_ops.models.modality import detect_modality

    requested, detected = run.model.modality, detect_modality(run.model.path)
    if requested != "auto" and detected is not None and detected != requested:
        problems.append(
            ConfigProblem(
                "model.modality",
                f"{requested} but model.path={run.model.path!r} is a {detected} model (by its config.json)",
                "set model.modality=auto",
            )
        )
        return
    modality = detected if requested == "auto" else requested
    if modality != "vision_language":
        return
    what = "with a vision-language policy"
    rules = [
        (
            run.needs_critic,
            "algorithm.adv_estimator",
            f"gae needs a critic (a value head on the policy), not built {what}",
            "use grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or remax",
        ),
        (
            run.reward.model_path is not None,
            "reward.model_path",
            f"reward models are text-only sequence classifiers and never see the images {what}",
            "score with reward.reward_fn instead",
        ),
        (
            not getattr(ROLLOUT_ENGINES.find(run.rollout.engine), "vision", True),
            "rollout.engine",
            f"the {run.rollout.engine} engine receives token ids only, no images, {what}",
            "set rollout.engine=" + " or ".join(e.name for e in ROLLOUT_ENGINES if e.vision),
        ),
        (
            run.actor.ulysses_sequence_parallel_size > 1,
            "actor.ulysses_sequence_parallel_size",
            f"Ulysses does not shard image tokens {what}",
            "set 1",
        ),
        (
            run.actor.share_prompt_prefix,
            "actor.share_prompt_prefix",
            f"a prompt's image features are not shared across its responses {what}",
            "set false",
        ),
        (
            run.model.lora.rank > 0,
            "model.lora.rank",
            f"LoRA is not supported {what} ('all-linear' would also adapt the vision tower)",
            "set 0 (full fine-tuning)",
        ),
    ]
    problems.extend(ConfigProblem(key, message, fix) for bad, key, message, fix in rules if bad)


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
    sections = [("actor", run.actor.fsdp), ("ref", run.ref.fsdp)]
    if run.needs_critic:
        sections.append(("critic", run.critic.fsdp))
    if run.reward.model_path is not None:
        sections.append(("reward", run.reward.fsdp))
    for section, fsdp in sections:
        _check_fsdp_knobs(section, fsdp, run.world_size, problems)
    rm_replicas = run.reward.fsdp.hsdp_replicate_size  # the trained roles' is checked with their batch sizes
    if run.reward.model_path is not None and run.world_size % rm_replicas:
        problems.append(
            ConfigProblem(
                "reward.fsdp.hsdp_replicate_size",
                f"{rm_replicas} does not divide the world size {run.world_size}",
                f"set a divisor of {run.world_size} (e.g. the number of nodes)",
            )
        )
    _check_frozen_fsdp("ref", run.ref.fsdp, problems)
    _check_frozen_fsdp("reward", run.reward.fsdp, problems)
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
    _check_ppo_sizes("actor", run.actor, run, problems)
    if run.needs_critic:
        _check_ppo_sizes("critic", run.critic, run, problems)
    _check_gpu_share(run, problems)
    _check_algorithm(run, problems)
    _check_rest(run, problems)
    _check_vision_language(run, problems)
    _check_reward(run, problems)
    _check_surface(run, problems)
    problems.extend(extension_problems(run))
    problems.extend(off_policy_problems(run))
    problems.extend(checkpoint_problems(run.trainer))
    problems.extend(lora_problems(run))
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
