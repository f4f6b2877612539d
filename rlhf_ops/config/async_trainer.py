"""``trainer.async_rollout``: the keys of ``trainer.pipeline=async`` (a rollout group of its own, a bounded buffer
of finished samples, a staleness bound, partial rollout).

Its own module so the schema stays readable; :class:`~rlhf_ops.config.schema.TrainerConfig` holds
:class:`AsyncRolloutConfig`. Cross-field rules: :mod:`rlhf_ops.config.async_rules`. Design and measurements:
``docs/async_rollout.md`` ("Asynchronous trainer").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ops.config.section import Section

StalePolicy = Literal["drop", "correct"]
WeightTransport = Literal["object_store", "remote_store"]
ResumeBuffer = Literal["keep", "regenerate"]

PIPELINE_DOC = (
    "Rollout pipelining: 'sync' (generate, then train), 'one_step_off' (generate step k+1's batch with the weights "
    "before update k while step k trains; needs rollout.mode=async) or 'async' (a rollout group of its own streams "
    "finished batches into a bounded buffer, the actor's weights are pushed to it after each update and the lag is "
    "bounded by trainer.async_rollout.max_staleness). docs/async_rollout.md."
)
ASYNC_DOC = "trainer.pipeline=async: the staleness bound, the buffer, the rollout workers, the weight transport."


class AsyncRolloutConfig(Section):
    """Settings of ``trainer.pipeline=async``; ignored by the other pipelines."""

    max_staleness: int = Field(
        1,
        description="Largest policy lag a trained sample may have: actor updates between the oldest weights that "
        "generated one of its tokens and the update that trains it (verl's async_training.staleness_threshold). "
        "0 is on-policy (rollout and update alternate on their own groups). Must be >= 0.",
    )
    stale_policy: StalePolicy = Field(
        "drop",
        description="A batch whose lag exceeds max_staleness: 'drop' (its prompts are generated again with the "
        "newest weights; counted in async/dropped_rows) or 'correct' (trained, weighted by "
        "algorithm.rollout_correction, which must be set; counted in async/corrected_rows).",
    )
    buffer_batches: int | None = Field(
        None,
        description="Batches generated ahead of the trainer (in flight or finished in the buffer); the rollout "
        "group idles when it is full. None: max_staleness + 1, which keeps every batch within the bound. "
        "A deeper buffer keeps the rollout group busier and makes stale batches (stale_policy applies).",
    )
    num_workers: int = Field(1, description="Rollout worker processes (each a full copy of the model), >= 1.")
    num_cpus_per_worker: float = Field(
        1.0, description="CPUs Ray reserves for each rollout worker (outside the training ranks' placement group)."
    )
    threads_per_worker: int = Field(1, description="Torch intra-op threads of each rollout worker, >= 1.")
    partial_rollout: bool = Field(
        True,
        description="Cut generations at weight updates: every partial_rollout_tokens tokens a worker takes the newest "
        "weights and continues the unfinished rows with them (the prefix is prefilled again); each token's policy "
        "version is recorded. false: a request finishes with the weights it started with.",
    )
    partial_rollout_tokens: int = Field(
        16, description="Tokens generated between two chances to take new weights (partial_rollout), >= 1."
    )
    weight_transport: WeightTransport = Field(
        "object_store",
        description="How the actor's weights reach the rollout group after each update: 'object_store' (one "
        "ray.put, every worker reads it) or 'remote_store' (a safetensors file under weight_store_url: groups "
        "that share nothing but the store).",
    )
    weight_store_url: str | None = Field(
        None,
        description="With weight_transport=remote_store: the folder URL (file://, s3://, any fsspec protocol) the "
        "weights are written to; None: <trainer.remote_store_url>/<experiment>/<run>/rollout_weights.",
    )
    resume_buffer: ResumeBuffer = Field(
        "keep",
        description="What a checkpoint does with the buffer: 'keep' saves its finished batches, which resume trains "
        "as they are (batches in flight are generated again); 'regenerate' saves none and resume generates every "
        "pending batch again. Either way no batch is both (async/resume_kept_rows, async/resume_regenerated_rows).",
    )

    @property
    def depth(self) -> int:
        """Batches admitted ahead of the trainer (``buffer_batches`` or ``max_staleness + 1``)."""
        return self.buffer_batches if self.buffer_batches is not None else self.max_staleness + 1
