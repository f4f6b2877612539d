"""The rules of the roles' FSDP sections: mesh sizes, wrap policy, keys a frozen role would ignore."""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import FSDPConfig, RunConfig

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


def fsdp_problems(run: RunConfig) -> list[ConfigProblem]:
    """Every started role's ``fsdp`` section (the reward model's when it has one)."""
    problems: list[ConfigProblem] = []
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
    return problems
