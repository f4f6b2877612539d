"""The asynchronous trainer (``trainer.pipeline=async``): a rollout group of its own generates ahead of the
trainer into a bounded buffer; the trainer takes a batch as soon as all of it is finished; the actor's weights
are pushed to the group after each update; the policy lag of what is trained is bounded.

Notation: k = the training step (1-based); the actor has seen k - 1 updates when step k trains; D =
``buffer_batches`` (default ``max_staleness + 1``); v(row) = the oldest policy version among the row's tokens
(``token_policy_version``: partial rollout may generate a row under several versions).

Admission: before step k trains, batches k .. k + D - 1 are admitted (drawn from the loader and submitted with
``min_version`` = the actor's version then); a worker never starts one with older weights. A batch admitted
after update j is trained at step j + D at the latest, so its lag (k - 1) - v(row) is at most D - 1; with
partial rollout its tokens can only be newer. The buffer holds the finished batches not trained yet: the
rollout group idles when D batches are finished or in flight. A batch whose largest lag exceeds
``max_staleness`` (a buffer deeper than ``max_staleness + 1``) is dropped and its prompts generated again at the
front of the queue, or kept and weighted by ``algorithm.rollout_correction`` (``stale_policy``); both counted.

Resume: the checkpoint holds the loader position before the oldest batch not trained, and (``resume_buffer=keep``)
the finished batches; resume draws the same prompts again, restores the finished ones and generates the others
again: each pending batch is either kept or regenerated, never both (``async/resume_kept_rows``,
``async/resume_regenerated_rows`` on the first step after resume). Design: ``docs/async_rollout.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf_ops.config.async_trainer import AsyncRolloutConfig
from rlhf_ops.data.dataset import PromptLoader
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.trainer.generation import gen_keys, merge_generation
from rlhf_ops.trainer.one_step_off import decode_tensors, encode_tensors
from rlhf_ops.trainer.timing import StageTimer

__all__ = ["AsyncPipeline"]

VERSION_KEY = "token_policy_version"


class RolloutGroup(Protocol):
    """:class:`workers.rollout.async_group.AsyncRolloutGroup`."""

    def submit(
        self, batch_id: int, prompts: DataProto, sampling: SamplingParams, *, n: int, min_version: int, front: bool
    ) -> int: ...
    def poll(self, timeout_s: float) -> list[tuple[int, int, DataProto]]: ...
    def push_weights(self, state: dict[str, torch.Tensor], version: int) -> None: ...
    def stats(self) -> list[dict[str, float]]: ...


class WeightSource(Protocol):
    """The actor group (``ActorRolloutRefClient.full_state_dict``)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


@dataclass
class _Batch:
    step: int
    prompts: DataProto  # repeated n times, interleaved
    epoch: int
    loader_before: dict[str, int]
    parts: int = 0  # requests it was split into (0: not submitted yet)
    done: dict[int, DataProto] = field(default_factory=dict)
    generated: DataProto | None = None  # set when every part is done (or restored from a checkpoint)


class AsyncPipeline:
    """Hands the trainer each step's batch from the buffer, keeping up to D batches admitted ahead."""

    def __init__(
        self,
        group: RolloutGroup,
        actor: WeightSource,
        loader: PromptLoader,
        *,
        n: int,
        sampling: Callable[[], SamplingParams],
        total_steps: int,
        config: AsyncRolloutConfig,
        poll_s: float = 0.05,
    ) -> None:
        self.group, self.actor, self.loader, self.n = group, actor, loader, n
        self.sampling, self.total_steps, self.config, self.poll_s = sampling, total_steps, config, poll_s
        self._batches: dict[int, _Batch] = {}  # admitted, not trained yet, by step
        self._version: int | None = None  # the version last pushed to the group
        self.counts = {"dropped_rows": 0, "corrected_rows": 0, "resume_kept_rows": 0, "resume_regenerated_rows": 0}
        self._step_metrics: dict[str, float] = {}
        self._mark = time.perf_counter()  # the end of the previous step
        self._stats: list[dict[str, float]] = []  # the workers' counters at the previous step's end

    # ---- per step -----------------------------------------------------------------------------
    def next_batch(self, step: int, timer: StageTimer) -> tuple[DataProto, int, float]:
        """Step ``step``'s batch (waited for), its epoch and its mean policy lag over rows."""
        version = step - 1  # updates the actor has seen
        if self._version != version:  # first step of a run or of a resume: the group gets the actor's weights
            self._push(version, timer)
        self._admit(step, version)
        batch = self._batches[step]
        waited = 0.0
        while True:
            start = time.perf_counter()
            while batch.generated is None:
                self._collect(self.poll_s)
            waited += time.perf_counter() - start
            lag = version - _oldest_versions(batch.generated)
            if int(lag.max()) <= self.config.max_staleness:
                break
            if self.config.stale_policy == "correct":
                self.counts["corrected_rows"] += int((lag > self.config.max_staleness).sum())
                break
            self.counts["dropped_rows"] += len(batch.prompts)  # generated again, first in the queue
            batch.generated, batch.done = None, {}
            self._submit(batch, version, front=True)
        self._batches.pop(step)
        timer.add("gen", waited)
        finished = sum(b.generated is not None for b in self._batches.values())
        self._step_metrics = {
            "training/policy_lag_max": float(lag.max()),
            "async/buffer_depth": float(finished),
            "async/in_flight": float(len(self._batches) - finished),
            "async/trainer_wait_s": waited,
            **{f"async/{k}": float(v) for k, v in self.counts.items()},
        }
        generated = batch.generated
        assert generated is not None
        return (
            merge_generation(batch.prompts, generated, keys=gen_keys(generated)),
            batch.epoch,
            float(lag.double().mean()),
        )

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        """After step ``step``'s update: pushes the new weights, admits the next batches; returns the step's metrics
        (lag, buffer, idle fractions: the trainer's wait over the step's wall time, the workers' idle seconds over
        their busy + idle seconds since the previous step)."""
        self._push(step, timer)
        if step < self.total_steps:
            self._admit(step + 1, step)
        now = time.perf_counter()
        metrics = dict(self._step_metrics)
        metrics["async/trainer_idle_frac"] = metrics.get("async/trainer_wait_s", 0.0) / max(now - self._mark, 1e-9)
        self._mark = now
        stats = self.group.stats()
        busy = sum(s["busy_s"] for s in stats) - sum(s["busy_s"] for s in self._stats)
        idle = sum(s["idle_s"] for s in stats) - sum(s["idle_s"] for s in self._stats)
        metrics["async/rollout_idle_frac"] = idle / max(busy + idle, 1e-9)
        metrics["async/rollout_busy_s"] = busy  # generating, over the workers, since the previous step
        tokens = sum(s.get("tokens", 0.0) for s in stats) - sum(s.get("tokens", 0.0) for s in self._stats)
        metrics["async/rollout_tokens_per_s"] = tokens / busy if busy > 0 else 0.0
        self._stats = stats
        metrics["async/partial_cuts"] = sum(s.get("cuts", 0.0) for s in stats)
        for key in ("resume_kept_rows", "resume_regenerated_rows"):
            self.counts[key] = 0  # reported once, on the first step after the resume
        return metrics

    def drain(self) -> None:
        """Nothing to wait for: validation and saves use the actor group, not the rollout group."""

    # ---- internals ----------------------------------------------------------------------------
    def _push(self, version: int, timer: StageTimer) -> None:
        with timer.stage("weight_push"):
            self.group.push_weights(self.actor.full_state_dict(), version)
        self._version = version

    def _admit(self, step: int, version: int) -> None:
        """Draws and submits batches up to step + D - 1 (and any restored batch not submitted yet)."""
        last = min(step + self.config.depth - 1, self.total_steps)
        for k in range(step, last + 1):
            if k not in self._batches:
                before = self.loader.state_dict()
                prompts = self.loader.next_batch().repeat(self.n, interleave=True)
                self._batches[k] = _Batch(k, prompts, self.loader.epoch, before)
        for batch in self._batches.values():
            if batch.generated is None and batch.parts == 0:
                self._submit(batch, version, front=False)

    def _submit(self, batch: _Batch, version: int, *, front: bool) -> None:
        batch.parts = self.group.submit(
            batch.step, batch.prompts, self.sampling(), n=self.n, min_version=version, front=front
        )

    def _collect(self, timeout_s: float) -> None:
        for step, part, data in self.group.poll(timeout_s):
            batch = self._batches.get(step)
            if batch is None or batch.generated is not None:
                continue  # a part of a batch dropped and submitted again: the new parts replace it
            batch.done[part] = data
            if len(batch.done) == batch.parts:
                batch.generated = DataProto.concat([batch.done[i] for i in range(batch.parts)])
                batch.done = {}

    # ---- checkpoint ---------------------------------------------------------------------------
    def loader_state(self) -> dict[str, int]:
        """The loader position before the oldest batch not trained (its prompts and the later ones are drawn again)."""
        if not self._batches:
            return self.loader.state_dict()
        return dict(self._batches[min(self._batches)].loader_before)

    def state_dict(self) -> dict[str, Any]:
        """Every pending batch in order: its generated tensors when finished and ``resume_buffer=keep``, else None."""
        keep = self.config.resume_buffer == "keep"
        if keep:  # finished parts still with the workers join the buffer now (they would be generated again)
            self._collect(0.0)
        records = []
        for step in sorted(self._batches):
            b = self._batches[step]
            tensors = None
            if keep and b.generated is not None:
                tensors = encode_tensors(b.generated, [*gen_keys(b.generated), VERSION_KEY])
            records.append({"step": step, "epoch": b.epoch, "tensors": tensors})
        return {"batches": records}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Draws the saved batches' prompts again (the loader is at :meth:`loader_state`); restores the finished
        ones, leaves the others to be generated again.

        Raises:
            ValueError: The redrawn prompts are not the ones a saved batch was generated from.
        """
        self._batches = {}
        for record in (state or {}).get("batches", []):
            before = self.loader.state_dict()
            prompts = self.loader.next_batch().repeat(self.n, interleave=True)
            batch = _Batch(int(record["step"]), prompts, self.loader.epoch, before)
            if record["tensors"] is not None:
                generated = decode_tensors(record["tensors"])
                if not torch.equal(generated.tensors["prompts"], prompts.tensors["input_ids"]):
                    raise ValueError(
                        f"the checkpoint's buffered batch for step {record['step']} does not match the prompts the "
                        "loader draws at its saved position (data changed since it was written); resume with the "
                        "same data, or set trainer.async_rollout.resume_buffer=regenerate"
                    )
                batch.generated = generated
                self.counts["resume_kept_rows"] += len(prompts)
            else:
                self.counts["resume_regenerated_rows"] += len(prompts)
            self._batches[batch.step] = batch
        self._version = None  # the group has the initial weights: push the resumed actor's first


def _oldest_versions(generated: DataProto) -> torch.Tensor:
    """(B,) the oldest policy version among each row's response tokens."""
    versions = generated.tensors[VERSION_KEY]
    mask = generated.tensors["response_mask"].bool()
    big = torch.iinfo(versions.dtype).max
    oldest = versions.masked_fill(~mask, big).min(-1).values
    return torch.where(oldest == big, versions.max(-1).values, oldest)
