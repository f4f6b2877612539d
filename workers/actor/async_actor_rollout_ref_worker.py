"""``AsyncActorRolloutRefWorker``: the ActorRolloutRef worker whose rollout is vLLM's ``AsyncLLM``.

Selected by ``rollout.mode=async`` (``workers.launcher.role_table``). Everything but the engine is the parent's:
the FSDP2 actor and reference, the sharding manager (gather bucket by bucket, mark dirty after each update,
resume / release around generation) and the worker-group methods, which stay synchronous for the
controller. The engine (:class:`~workers.rollout.async_vllm_rollout.AsyncVLLMRollout`) runs its engine core
in another process and an event loop on a thread of this one: ``generate_sequences`` submits every sample as
its own request and gathers them; its ``async def`` methods (``agenerate``, ``generate_one``) serve callers
that run their own loop. Design and the vLLM 0.32 findings: ``docs/async_rollout.md``.
"""

from __future__ import annotations

from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.rollout.base import RolloutEngine

__all__ = ["AsyncActorRolloutRefWorker"]


class AsyncActorRolloutRefWorker(ActorRolloutRefWorker):
    """One rank of the actor / rollout / reference group with an async vLLM rollout engine."""

    def _build_vllm_engine(self) -> RolloutEngine:
        from workers.rollout.async_vllm_rollout import AsyncVLLMRollout

        spec = self.spec
        if spec.rollout.mode != "async" or spec.rollout.engine != "vllm":
            raise ValueError(
                f"AsyncActorRolloutRefWorker needs rollout.mode=async and rollout.engine=vllm (got "
                f"mode={spec.rollout.mode}, engine={spec.rollout.engine}); use ActorRolloutRefWorker for sync."
            )
        return AsyncVLLMRollout(
            spec.model_path,
            config=spec.rollout,
            pad_token_id=spec.pad_token_id,
            eos_token_id=spec.eos_token_id,
            seed=spec.seed + 1000 * self.rank,
            device="cuda" if self.device.type == "cuda" else "cpu",
            max_prompt_length=spec.plan.max_prompt_length,
        )
