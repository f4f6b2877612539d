"""The rules of vision-language policies: what such a policy cannot use yet."""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.extensions import ROLLOUT_ENGINES


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


def vision_language_problems(run: RunConfig) -> list[ConfigProblem]:
    """What a vision-language policy (``model.modality``, or detected from config.json) cannot use yet."""
    problems: list[ConfigProblem] = []
    _check_vision_language(run, problems)
    return problems
