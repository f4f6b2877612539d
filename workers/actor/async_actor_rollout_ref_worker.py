"""``AsyncActorRolloutRefWorker``: the ActorRolloutRef worker whose rollout is vLLM's ``AsyncLLM``.

Selected by ``rollout.mode=async`` (``workers.role_specs.actor_rollout_ref``). Everything but the engine is the
parent's: the FSDP2 actor and reference, the sharding manager (gather bucket by bucket, mark dirty after each update,
resume / release around generation) and the worker-group methods, which stay synchronous for the
controller. The engine (:class:`~workers.rollout.async_vllm_rollout.AsyncVLLMRollout`) runs its engine core
in another process and an event loop on a thread of this one: ``generate_sequences`` submits every sample as
its own request and gathers them; its ``async def`` methods (``agenerate``, ``generate_one``) serve callers
that run their own loop. Design and the vLLM 0.32 findings: ``docs/async_rollout.md``.

One-step off-policy pipelining (``trainer.pipeline=one_step_off``) adds two methods: :meth:`submit_sequences`
syncs the actor's weights into the engine on the calling (Ray method) thread, so the FSDP all-gathers never
run beside another call's collectives, then starts the rollout on a background thread and returns; the ranks
go on training while the engine-core process generates. :meth:`collect_sequences` waits for that rollout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from rlhf_ops.extensions import RolloutEngineSpec
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.rollout.base import EngineContext, RolloutEngine
from workers.single_controller.decorator import Dispatch, register
from workers.utils.profiling import monitored

__all__ = ["AsyncActorRolloutRefWorker"]


@dataclass
class _Prefetch:
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
        except BaseException as exc:  # re-raised by collect_sequences on the Ray method thread
            self.error = exc
        finally:
            self.done.set()


class AsyncActorRolloutRefWorker(ActorRolloutRefWorker):
    """One rank of the actor / rollout / reference group with an async vLLM rollout engine."""

    _prefetch: _Prefetch | None = None

    def _build_engine(self, entry: RolloutEngineSpec, context: EngineContext) -> RolloutEngine:
        """The entry's async engine (``async_target``): for vLLM an ``AsyncLLM``, its engine core in a process."""
        spec = self.spec
        if spec.rollout.mode != "async" or entry.async_target is None:
            raise ValueError(
                f"AsyncActorRolloutRefWorker needs rollout.mode=async and an engine with an async mode (got "
                f"mode={spec.rollout.mode}, engine={spec.rollout.engine}); use ActorRolloutRefWorker for sync."
            )
        engine: RolloutEngine = entry.load_async()(context)
        return engine

    # ------------------------------------------------------------------------------------------- prefetch
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("generate_submit")
    def submit_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Syncs the weights into the engine (when they changed), starts the rollout of ``prompts`` in the
        background and returns at once: a receipt, ``submitted`` (rows,) bool, with the sync's seconds in
        ``meta_info["timing"]["update_weights"]``. Same inputs and seeding as ``generate_sequences``.

        The engine generates while the ranks run the step's forwards and update, with the weights of this call.
        It stays awake across steps (GPU: no sleep / wake-up per step, its weights and KV cache stay resident
        next to the optimizer state); only a ``generate_sequences`` call (validation) puts it to sleep after.

        Raises:
            RuntimeError: A rollout submitted earlier was not collected yet.
        """
        self._need("rollout", "submit_sequences")
        assert self.rollout is not None and self.sharding_manager is not None
        if self._prefetch is not None:
            raise RuntimeError("submit_sequences: the previous rollout was not collected; call collect_sequences.")
        prompts = prompts.to(self.device)
        # Wake (a no-op when awake) + weight sync (when the actor changed) here, on the method thread. No exit
        # in collect: the next submit follows at once, and a sleep in between would only copy the weights out
        # and back (GPU with free_cache_engine; on CPU both are no-ops).
        self.sharding_manager.__enter__()
        sync_s = float(self.sharding_manager.last_metrics.get("timing_s/update_weights", 0.0))
        pending = _Prefetch(prompts, sync_s, sampling, step)  # the engine takes them as generate_sequences does
        threading.Thread(target=pending.run, args=(self.rollout,), name="rollout-prefetch", daemon=True).start()
        self._prefetch = pending
        receipt = {"submitted": torch.ones(len(prompts), dtype=torch.bool)}
        return DataProto.from_dict(receipt, meta_info={"timing": {"update_weights": sync_s}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("generate_collect")
    def collect_sequences(self, prompts: DataProto) -> DataProto:
        """Waits for the rollout :meth:`submit_sequences` started and returns it (``generate_sequences``'s keys).

        ``prompts`` are the submitted ones (the driver splits them the same way): their ``input_ids`` must equal
        the submitted rows', so a driver that lost track of its prefetch fails here rather than training on the
        wrong rows. ``meta_info["timing"]``: the engine's ``generate_sequences`` seconds (measured in the
        background), ``update_weights`` (the submit's sync) and ``generate_wait`` (how long this call waited).

        Raises:
            RuntimeError: Nothing was submitted, or the rows differ from the submitted ones.
        """
        self._need("rollout", "collect_sequences")
        pending, self._prefetch = self._prefetch, None
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
