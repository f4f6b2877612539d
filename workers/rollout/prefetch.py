"""One rollout running in the background while the ranks train: the one-step off-policy pipeline's engine side
(``trainer.pipeline=one_step_off``), held by the actor worker as a part rather than by a subclass.

The worker syncs the actor's weights into the engine on the Ray method thread (so the FSDP all-gathers never run
beside another call's collectives) and hands the engine to :meth:`RolloutPrefetch.submit`, which starts
``generate_sequences`` on a daemon thread and returns; :meth:`RolloutPrefetch.collect` waits for it. Only an
engine that generates outside the worker's own module (vLLM's ``AsyncLLM``: its engine core is another process)
may run this way; the HF engine decodes with the module being trained.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from workers.rollout.base import RolloutEngine

__all__ = ["RolloutPrefetch"]


@dataclass
class _Pending:
    """A rollout running on a daemon thread (daemon: a worker that exits never waits for a generation)."""

    prompts: DataProto
    sync_s: float
    sampling: SamplingParams | None = None
    step: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: DataProto | None = None
    error: BaseException | None = None

    def run(self, engine: RolloutEngine) -> None:
        try:
            self.result = engine.generate_sequences(self.prompts, self.sampling, self.step)
        except BaseException as exc:  # re-raised by collect on the Ray method thread
            self.error = exc
        finally:
            self.done.set()


class RolloutPrefetch:
    """At most one background rollout: :meth:`submit` starts it, :meth:`collect` returns it."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None

    def submit(
        self,
        engine: RolloutEngine,
        prompts: DataProto,
        *,
        sync_s: float,
        sampling: SamplingParams | None = None,
        step: int | None = None,
    ) -> DataProto:
        """Starts ``engine.generate_sequences(prompts, sampling, step)`` in the background and returns a receipt:
        ``submitted`` (rows,) bool, with the weight sync's seconds (``sync_s``, done by the caller) in
        ``meta_info["timing"]["update_weights"]``.

        Raises:
            RuntimeError: A rollout submitted earlier was not collected yet.
        """
        if self._pending is not None:
            raise RuntimeError("submit_sequences: the previous rollout was not collected; call collect_sequences.")
        pending = _Pending(prompts, sync_s, sampling, step)
        threading.Thread(target=pending.run, args=(engine,), name="rollout-prefetch", daemon=True).start()
        self._pending = pending
        receipt = {"submitted": torch.ones(len(prompts), dtype=torch.bool)}
        return DataProto.from_dict(receipt, meta_info={"timing": {"update_weights": sync_s}})

    def collect(self, prompts: DataProto) -> DataProto:
        """Waits for the submitted rollout and returns it on the CPU (``generate_sequences``' keys).

        ``prompts`` are the submitted ones (the driver splits them the same way): their ``input_ids`` must equal
        the submitted rows', so a driver that lost track of its prefetch fails here rather than training on the
        wrong rows. ``meta_info["timing"]``: the engine's own seconds (measured in the background),
        ``update_weights`` (the submit's sync) and ``generate_wait`` (how long this call waited).

        Raises:
            RuntimeError: Nothing was submitted, or the rows differ from the submitted ones.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("collect_sequences: no rollout was submitted; call submit_sequences first.")
        start = time.perf_counter()
        pending.done.wait()
        wait_s = time.perf_counter() - start
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        if not torch.equal(prompts.tensors["input_ids"].cpu(), pending.prompts.tensors["input_ids"].cpu()):
            raise RuntimeError("collect_sequences: the rows differ from the submitted ones (driver out of step).")
        out = pending.result
        timing = {**(out.meta_info.get("timing") or {}), "update_weights": pending.sync_s, "generate_wait": wait_s}
        out.meta_info["timing"] = timing
        return out.to("cpu")
