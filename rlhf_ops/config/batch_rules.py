"""The rules of batch sizes and meshes: mini / micro batches over the data-parallel ranks, sequence parallel,
shared prompt prefixes, GPU sharing."""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import ActorConfig, CriticConfig, RunConfig


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


def _check_prompt_attention(
    section: str, cfg: ActorConfig | CriticConfig, run: RunConfig, problems: list[ConfigProblem]
) -> None:
    """``<section>.share_prompt_attention=per_prompt`` runs sdpa per group of the shared-prompt row."""
    key = f"{section}.share_prompt_attention"
    if not cfg.share_prompt_prefix:
        problems.append(
            ConfigProblem(
                key,
                f"per_prompt attends the shared-prompt packed row group by group, and {section}.share_prompt_prefix "
                "is off",
                f"set {section}.share_prompt_prefix=true, or {key}=dense",
            )
        )
    if run.model.attn_implementation != "sdpa":
        problems.append(
            ConfigProblem(
                key,
                f"per_prompt runs sdpa per prompt group, and model.attn_implementation is "
                f"{run.model.attn_implementation}",
                f"set model.attn_implementation=sdpa, or {key}=dense",
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
    if cfg.share_prompt_attention == "per_prompt":
        _check_prompt_attention(section, cfg, run, problems)
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


def batch_size_problems(run: RunConfig) -> list[ConfigProblem]:
    """The trained roles' batch sizes against the world size and the rollout; GPU sharing."""
    problems: list[ConfigProblem] = []
    _check_ppo_sizes("actor", run.actor, run, problems)
    if run.needs_critic:
        _check_ppo_sizes("critic", run.critic, run, problems)
    _check_gpu_share(run, problems)
    return problems
