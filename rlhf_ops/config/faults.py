"""The ``trainer`` keys of fault tolerance: time-based checkpoints, preemption notice, rollout watchdog, store
retries.

Its own module so the schema stays readable: :class:`~rlhf_ops.config.schema.TrainerConfig` derives from
:class:`FaultToleranceKeys`, so the keys are ``trainer.save_every_s`` and so on. What each one does at run time:
``docs/reliability.md`` ("Faults and recovery").
"""

from __future__ import annotations

from pydantic import Field

from rlhf_ops.config.section import Section


class FaultToleranceKeys(Section):
    """Keys of ``trainer`` that bound what a fault costs (wall time lost, time to detect a hang)."""

    save_every_s: float | None = Field(
        None,
        gt=0.0,
        description="Also checkpoint after the first step that ends at least this many seconds after the last "
        "checkpoint (or the start): a kill loses at most about this much wall time. None: only save_freq.",
    )
    preemption_grace_s: float = Field(
        30.0,
        gt=0.0,
        description="Seconds between a preemption notice (a SIGTERM to the driver, or to one of the run's ranks as "
        "when its node is drained) and the hard stop: the trainer checkpoints at the end of the running step and "
        "exits as preempted (exit code 75); if the step and the save cannot end within it, it says so and exits "
        "without the checkpoint.",
    )
    rollout_watchdog_s: float | None = Field(
        None,
        gt=0.0,
        description="Seconds a call of the rollout workers during a step (generation, log-probs, the actor update) "
        "may run without every rank returning before the step fails naming the ranks that did not (a hung engine, a "
        "stopped process). Set it above the slowest such call. None: wait as long as it takes.",
    )
    store_retries: int = Field(
        5, ge=0, description="Retries of a failed remote-store transfer (per file) before the save fails."
    )
    store_backoff_s: float = Field(
        0.5, ge=0.0, description="Base delay between store retries; retry i waits 0.5-1x this times 2**i (max 30 s)."
    )
