"""The ``trainer`` keys of reproducibility and stopping: bit-exact runs, rollout dumps and their replay, early stop.

Its own module so the schema stays readable: :class:`~rlhf_ops.config.schema.TrainerConfig` derives from
:class:`ReproducibilityKeys`, so the keys are ``trainer.deterministic``, ``trainer.dump_rollouts``,
``trainer.replay_rollouts`` and ``trainer.early_stop.*``. Cross-field rules:
:mod:`rlhf_ops.config.reproducibility_rules`. What each one does at run time: ``docs/reproducibility.md``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlhf_ops.config.section import Section, not_blank


class EarlyStopConfig(Section):
    """Stop training on a validation metric (NeMo-RL's ``stop_at_validation_threshold``, plus patience) or when a
    wall-clock budget is spent (Lightning's ``max_time``, but a step that would overrun is not started)."""

    metric: Annotated[str | None, not_blank("set a validation metric, e.g. 'val/reward/mean', or null")] = Field(
        None,
        description="Validation metric the rule reads after each validation (trainer.test_freq), e.g. "
        "'val/reward/mean' or 'val/<data_source>/reward/mean'. None: early stop is off.",
    )
    mode: Literal["max", "min"] = Field("max", description="'max': higher is better; 'min': lower is better.")
    threshold: float | None = Field(
        None,
        description="Stop once the metric reaches this value (>= with mode=max, <= with mode=min). None: none.",
    )
    patience: int | None = Field(
        None,
        gt=0,
        description="Stop after this many validations in a row without a new best (by more than min_delta). "
        "None: no patience rule.",
    )
    min_delta: float = Field(0.0, ge=0.0, description="How much a validation must beat the best to count as a win.")
    max_time_s: float | None = Field(
        None,
        gt=0.0,
        description="Wall-clock budget in seconds, from the driver's start (plus the time of a resumed run's earlier "
        "attempts up to their last checkpoint). After each step the run stops, as an early stop, when one more step "
        "as long as the slowest of the last three would end past it; the final checkpoint's save comes on top. "
        "Needs no validation. None: no budget.",
    )


class ReproducibilityKeys(Section):
    """Keys of ``trainer`` that make a run repeatable, replayable, or stop it on a validation metric."""

    deterministic: bool = Field(
        False,
        description="Bit-identical runs: deterministic torch algorithms, fixed thread counts and per-step, "
        "per-request sampling seeds, so two runs with the same seed (and a killed-and-resumed run) give the same "
        "metrics and weights bit for bit on the same host and software. Refuses settings that cannot be "
        "deterministic at pre-flight. Cost: docs/reproducibility.md.",
    )
    dump_rollouts: bool = Field(
        False,
        description="Write each step's scored batch (prompts, responses, masks, rollout log-probs, rewards, policy "
        "version) as Parquet under <run folder>/rollouts/ (and the remote store), for trainer.replay_rollouts.",
    )
    replay_rollouts: Annotated[str | None, not_blank("set the rollouts/ folder of a dumped run, or null")] = Field(
        None,
        description="Train on the batches of a trainer.dump_rollouts folder (local path or store URL) instead of "
        "generating: no rollout engine runs, the rewards are the dumped ones. None: generate as usual.",
    )
    early_stop: EarlyStopConfig = Field(default_factory=EarlyStopConfig)
