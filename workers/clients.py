"""Driver-side clients: the typed role interfaces of ``rlhf_ops.trainer.roles`` over Ray worker groups.

Each method is one ``group.call`` on a registered worker method; metrics come back in ``meta_info``
(one value per data-parallel rank) and are averaged here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.trainer.metrics import reduce_worker_metrics
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.critic.critic_worker import CriticWorker
from workers.reward_model.reward_model_worker import RewardModelWorker
from workers.single_controller.futures import WorkerGroupError
from workers.single_controller.worker_group import RayWorkerGroup


def _metrics(out: DataProto) -> dict[str, float]:
    merged: dict[str, Any] = dict(out.meta_info.get("metrics") or {})
    per_rank = [{k: v[i] for k, v in merged.items()} for i in range(min((len(v) for v in merged.values()), default=0))]
    return reduce_worker_metrics(per_rank)


class RolloutHangError(RuntimeError):
    """A call of the rollout workers returned nothing within ``trainer.rollout_watchdog_s``; names the ranks."""


class ActorRolloutRefClient:
    """:class:`~rlhf_ops.trainer.roles.ActorRolloutRef` over an ``ActorRolloutRefWorker`` group."""

    def __init__(self, group: RayWorkerGroup[ActorRolloutRefWorker], *, watchdog_s: float | None = None) -> None:
        self.group = group
        # trainer.rollout_watchdog_s: bound on each call of a step (rollout, log-probs, update); None: no bound.
        self.watchdog_s = watchdog_s

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, *, step: int | None = None
    ) -> DataProto:
        out: DataProto = self._watched(ActorRolloutRefWorker.generate_sequences, prompts, sampling, step=step)
        timing = out.meta_info.get("timing") or {}
        # concat keeps the first chunk's timing: rank 0's, representative of the (balanced) ranks.
        out.meta_info["timing"] = {k: float(v) for k, v in timing.items()}
        return out

    def submit_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, *, step: int | None = None
    ) -> DataProto:
        """Starts a rollout in the background (``rollout.mode=async`` groups only; one-step off-policy)."""
        receipt: DataProto = self.group.call(ActorRolloutRefWorker.submit_sequences, prompts, sampling, step=step)
        return receipt

    def collect_sequences(self, prompts: DataProto) -> DataProto:
        """The rollout :meth:`submit_sequences` started for the same ``prompts``."""
        out: DataProto = self._watched(ActorRolloutRefWorker.collect_sequences, prompts)
        out.meta_info["timing"] = {k: float(v) for k, v in (out.meta_info.get("timing") or {}).items()}
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        """The actor's full weights on CPU (a collective of every rank; rank 0's): the async rollout group's."""
        states: list[dict[str, Tensor]] = self.group.call(ActorRolloutRefWorker.full_state_dict)
        return states[0]

    def _watched(self, method: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``group.call`` bounded by ``watchdog_s``: a call that outlives it fails naming the ranks that returned
        nothing (a hung engine, a stopped process) instead of waiting for the scheduler's timeout.

        The group is shut down by then (its collectives are in an unknown state); the run fails and its retry
        resumes from the last checkpoint.
        """
        future = self.group.call_async(method, *args, **kwargs)
        try:
            return future.result(timeout_s=self.watchdog_s)
        except WorkerGroupError as err:
            stuck = str(getattr(err.cause, "args", [""])[0]) if err.rank is None and self.watchdog_s else ""
            if not stuck.startswith("ranks "):
                raise
            step = kwargs.get("step")
            at = f" at step {step}" if step is not None else ""
            raise RolloutHangError(
                f"rollout watchdog: {stuck.removesuffix(' still running')} of {err.role} returned nothing from "
                f"{future.method}(){at} within trainer.rollout_watchdog_s={self.watchdog_s:g} s (a hung engine or "
                "a stopped process); the worker group was shut down. Fix: look for that rank's process on its node, "
                "or raise trainer.rollout_watchdog_s if a call of these workers legitimately takes this long"
            ) from err

    def compute_ref_log_prob(self, data: DataProto, *, temperature: float = 1.0, step: int | None = None) -> DataProto:
        call = ActorRolloutRefWorker.compute_ref_log_prob
        result: DataProto = self._watched(call, data, temperature=temperature, step=step)
        return result

    def compute_log_prob(self, data: DataProto, *, temperature: float = 1.0, step: int | None = None) -> DataProto:
        call = ActorRolloutRefWorker.compute_log_prob
        result: DataProto = self._watched(call, data, temperature=temperature, step=step)
        return result

    def update_actor(self, data: DataProto, *, temperature: float = 1.0, step: int | None = None) -> dict[str, float]:
        return _metrics(self._watched(ActorRolloutRefWorker.update_actor, data, temperature=temperature, step=step))

    def save_checkpoint(self, path: str) -> None:
        self.group.call(ActorRolloutRefWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call(ActorRolloutRefWorker.load_checkpoint, path)

    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> list[RankUpload]:
        """Each rank's upload, ordered by rank (``trainer.shared_checkpoint_root=false``)."""
        uploads: list[RankUpload] = self.group.call(ActorRolloutRefWorker.save_checkpoint_to_store, ckpt, role)
        return uploads

    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None:
        self.group.call(ActorRolloutRefWorker.load_checkpoint_from_store, ckpt, role)


class CriticClient:
    """:class:`~rlhf_ops.trainer.roles.Critic` over a ``CriticWorker`` group."""

    def __init__(self, group: RayWorkerGroup[CriticWorker]) -> None:
        self.group = group

    def compute_values(self, data: DataProto, *, step: int | None = None) -> DataProto:
        result: DataProto = self.group.call(CriticWorker.compute_values, data, step=step)
        return result

    def update_critic(self, data: DataProto, *, step: int | None = None) -> dict[str, float]:
        return _metrics(self.group.call(CriticWorker.update_critic, data, step=step))

    def save_checkpoint(self, path: str) -> None:
        self.group.call(CriticWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call(CriticWorker.load_checkpoint, path)

    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> list[RankUpload]:
        """Each rank's upload, ordered by rank (``trainer.shared_checkpoint_root=false``)."""
        uploads: list[RankUpload] = self.group.call(CriticWorker.save_checkpoint_to_store, ckpt, role)
        return uploads

    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None:
        self.group.call(CriticWorker.load_checkpoint_from_store, ckpt, role)


class RewardModelClient:
    """:class:`~rlhf_ops.trainer.roles.RewardModel` over a ``RewardModelWorker`` group."""

    def __init__(self, group: RayWorkerGroup[RewardModelWorker]) -> None:
        self.group = group

    def compute_rm_score(self, data: DataProto) -> DataProto:
        result: DataProto = self.group.call(RewardModelWorker.compute_rm_score, data)
        return result
