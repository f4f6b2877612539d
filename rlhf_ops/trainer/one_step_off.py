"""One-step off-policy pipelining (``trainer.pipeline=one_step_off``): the batch of step k + 1 is generated
while step k trains.

Notation: k = the training step (1-based), B = rows (prompts x n), v(k) = how many actor updates the weights
that generated step k's batch had seen.

Order of step k (:meth:`OneStepOffPipeline.next_batch`, then the trainer's stages)::

    collect batch k            (submitted during step k - 1; step 1 and a resume without a saved batch
                                generate it here, synchronously)
    submit batch k + 1         (weight sync of the actor as it is now: k - 1 updates; returns at once)
    reward, old_log_prob, ref, advantages, update k ...   <- the engine generates batch k + 1 meanwhile

So batch k + 1 is sampled by the weights before update k and trained after it: ``training/policy_lag`` =
(k - 1) - v(k) is 1 from step 2 on (0 at step 1). The PPO ratio is taken against ``old_log_probs`` (the actor
now, the proximal policy); ``algorithm.rollout_correction`` weights each token by the truncated
``pi_old / pi_rollout`` to correct the lag (:mod:`rlhf_ops.algorithms.rollout_correction`).

Exact resume: a checkpoint after step k holds the prefetched batch k + 1 (its engine tensors, base64 in the
trainer state; the weights that sampled it are gone after update k, so it cannot be regenerated) and the
loader position *before* its prompts were drawn. Resume draws those prompts again (the same rows: the loader
is deterministic), checks them against the saved ``prompts`` tensor, and trains step k + 1 on the saved batch.
A checkpoint of a ``sync`` run (no saved batch) resumes here with step k + 1 generated synchronously.
Design and what overlaps on CPU vs GPU: ``docs/async_rollout.md``.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlhf_ops.data.dataset import PromptLoader
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.trainer.generation import gen_keys, merge_generation
from rlhf_ops.trainer.timing import StageTimer

__all__ = ["OneStepOffPipeline", "PrefetchingRollout", "decode_tensors", "encode_tensors"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.float32, torch.bool)}
_DTYPES.update({str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16, torch.uint8, torch.int8)})


@runtime_checkable
class PrefetchingRollout(Protocol):
    """A rollout group that generates in the background (``workers.clients.ActorRolloutRefClient`` on an
    ``ActorRolloutRefWorker`` group with ``rollout.mode=async``)."""

    def submit_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, *, step: int | None = None
    ) -> DataProto:
        """Syncs the weights into the engines and starts generating ``prompts``; returns at once."""
        ...

    def collect_sequences(self, prompts: DataProto) -> DataProto:
        """The generation :meth:`submit_sequences` started for the same ``prompts``."""
        ...


@dataclass
class _Rollout:
    """One step's rollout, in flight (``generated`` None) or done."""

    step: int  # the training step it is for
    prompts: DataProto  # the prompts, repeated n times (interleaved)
    epoch: int  # the loader's epoch when they were drawn
    weight_version: int  # actor updates the generating weights had seen
    loader_before: dict[str, int]  # the loader's state before they were drawn
    generated: DataProto | None = None
    timing: dict[str, float] = field(default_factory=dict)  # the collect's wait and the workers' seconds


def encode_tensors(data: DataProto, keys: list[str]) -> dict[str, dict[str, Any]]:
    """``keys`` of ``data`` as JSON-able records (dtype, shape, base64 of the raw bytes): exact for every dtype."""
    out = {}
    for key in keys:
        tensor = data.tensors[key].detach().cpu().contiguous()
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        out[key] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "data": ""}
        out[key]["data"] = base64.b64encode(raw).decode("ascii")
    return out


def decode_tensors(records: dict[str, dict[str, Any]]) -> DataProto:
    """The inverse of :func:`encode_tensors` (no pickle: dtype from a fixed table, bytes from base64)."""
    tensors = {}
    for key, record in records.items():
        dtype = _DTYPES.get(record["dtype"])
        if dtype is None:
            raise ValueError(f"saved rollout tensor {key!r} has dtype {record['dtype']!r}; known: {sorted(_DTYPES)}")
        raw = bytearray(base64.b64decode(record["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[key] = flat.view(dtype).reshape(record["shape"]).clone()
    return DataProto.from_dict(tensors)


class OneStepOffPipeline:
    """Hands the trainer each step's generated batch, keeping the next step's rollout in flight.

    Args:
        rollout: The actor / rollout group (:class:`PrefetchingRollout`).
        loader: The training prompts (the pipeline draws from it; the trainer does not, in this mode).
        n: Samples per prompt (``rollout.n``): prompts are repeated before generation, as the sync loop does.
        sampling: The training rollout's sampling settings (the trainer's ``sampling``).
        total_steps: The run's last step (no rollout is prefetched for a step after it).

    Raises:
        TypeError: ``rollout`` cannot generate in the background (not an async rollout group).
    """

    def __init__(
        self,
        rollout: object,
        loader: PromptLoader,
        *,
        n: int,
        sampling: Callable[[], SamplingParams],
        total_steps: int,
    ) -> None:
        if not isinstance(rollout, PrefetchingRollout):
            raise TypeError(
                f"trainer.pipeline=one_step_off needs a rollout group with submit_sequences / collect_sequences "
                f"(rollout.mode=async), got {type(rollout).__name__}"
            )
        self.rollout, self.loader, self.n = rollout, loader, n
        self.sampling, self.total_steps = sampling, total_steps
        self._next: _Rollout | None = None  # the rollout of the coming step, in flight or collected

    # ---- per step -----------------------------------------------------------------------------
    def next_batch(self, step: int, timer: StageTimer) -> tuple[DataProto, int, int]:
        """Step ``step``'s generated batch (prompts' columns merged in), its epoch and its policy lag; before
        returning, submits step ``step + 1``'s rollout (unless ``step`` is the last).

        Timers: ``gen`` (waiting for this step's batch: here, or earlier when a save or validation waited for
        it), ``gen_submit`` (the next one's weight sync and dispatch), ``worker/*`` (the engines' seconds for
        this batch, spent while the previous step trained). A batch restored from a checkpoint has none.
        """
        current, self._next = self._next, None
        if current is not None and current.step != step:
            raise RuntimeError(f"the prefetched rollout is for step {current.step}, not {step}: steps were skipped")
        # Before this step's update the actor has seen step - 1 updates: the weights both submits below sync.
        if current is None:  # step 1, or a resume whose checkpoint holds no batch: generate it now
            current = self._submit(step, timer, weight_version=step - 1)
        if current.generated is None:
            self._collect(current)
        assert current.generated is not None
        for name, seconds in current.timing.items():  # also when the wait happened earlier (a save, validation)
            timer.add(name, seconds)
        if step < self.total_steps:
            self._next = self._submit(step + 1, timer, weight_version=step - 1)
        batch = merge_generation(current.prompts, current.generated, keys=gen_keys(current.generated))
        return batch, current.epoch, (step - 1) - current.weight_version

    def drain(self) -> None:
        """Waits for the rollout in flight (before anything else generates or syncs weights: validation, a save)."""
        if self._next is not None and self._next.generated is None:
            self._collect(self._next)

    def _submit(self, step: int, timer: StageTimer, *, weight_version: int) -> _Rollout:
        loader_before = self.loader.state_dict()
        prompts = self.loader.next_batch().repeat(self.n, interleave=True)
        rollout = _Rollout(step, prompts, self.loader.epoch, weight_version, loader_before)
        with timer.stage("gen_submit"):
            self.rollout.submit_sequences(prompts, self.sampling(), step=step)
        return rollout

    def _collect(self, rollout: _Rollout) -> None:
        start = time.perf_counter()
        rollout.generated = self.rollout.collect_sequences(rollout.prompts)
        rollout.timing = {"gen": time.perf_counter() - start}
        for name, seconds in (rollout.generated.meta_info.get("timing") or {}).items():
            rollout.timing[f"worker/{name}"] = float(seconds)

    # ---- checkpoint ---------------------------------------------------------------------------
    def loader_state(self) -> dict[str, int]:
        """The loader position a checkpoint records: before the prefetched prompts (they travel as a batch)."""
        return dict(self._next.loader_before) if self._next is not None else self.loader.state_dict()

    def state_dict(self) -> dict[str, Any] | None:
        """The prefetched rollout (waited for), or None when there is none (the run's last step)."""
        if self._next is None:
            return None
        self.drain()
        rollout = self._next
        assert rollout.generated is not None
        return {
            "step": rollout.step,
            "epoch": rollout.epoch,
            "weight_version": rollout.weight_version,
            "tensors": encode_tensors(rollout.generated, gen_keys(rollout.generated)),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores the prefetched rollout; the loader must be at :meth:`loader_state` (it draws the prompts).

        Raises:
            ValueError: The redrawn prompts are not the ones the saved batch was generated from.
        """
        self._next = None
        if not state:
            return
        loader_before = self.loader.state_dict()
        prompts = self.loader.next_batch().repeat(self.n, interleave=True)
        generated = decode_tensors(state["tensors"])
        if self.loader.epoch != int(state["epoch"]) or not torch.equal(
            generated.tensors["prompts"], prompts.tensors["input_ids"]
        ):
            raise ValueError(
                f"the checkpoint's prefetched batch for step {state['step']} does not match the prompts the loader "
                "draws at its saved position (data files or data.* settings changed since it was written); resume "
                "with the same data, or from a checkpoint of a trainer.pipeline=sync run"
            )
        self._next = _Rollout(
            int(state["step"]), prompts, self.loader.epoch, int(state["weight_version"]), loader_before, generated
        )
