"""The driver's handle on the rollout group of ``trainer.pipeline=async``: :class:`AsyncRolloutWorker` processes
started as Ray actors of their own (outside the training ranks' placement group: not colocated), or in this
process (tests, and a one-process run).

A request of B rows is split between the workers in whole groups of ``n`` rows; each part is its own request
(``<batch id>/<part>``). Weights reach the workers by one of two transports (``weight_transport``):
``object_store`` puts the state dict in Ray's object store once and every worker reads it; ``remote_store``
writes one safetensors file under a store URL, which each worker reads before its ``push_weights`` returns
(then the previous version's file is deleted), for groups that share nothing but the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from workers.rollout.async_rollout_worker import AsyncRolloutWorker, RolloutWorkerSpec, write_weights

__all__ = ["AsyncRolloutGroup"]


class AsyncRolloutGroup:
    """Workers of the rollout group; ``remote`` says whether they are Ray actor handles or local objects."""

    def __init__(
        self,
        workers: Sequence[Any],
        *,
        remote: bool,
        weight_transport: str = "object_store",
        weight_store_url: str | None = None,
    ) -> None:
        if weight_transport == "remote_store" and not weight_store_url:
            raise ValueError("weight_transport=remote_store needs a weight_store_url")
        self.workers, self.remote = list(workers), remote
        self.weight_transport, self.weight_store_url = weight_transport, weight_store_url
        self._stored: str | None = None  # the last weights file written (remote_store)

    @classmethod
    def launch(
        cls,
        spec: RolloutWorkerSpec,
        *,
        num_workers: int,
        num_cpus: float,
        weight_transport: str = "object_store",
        weight_store_url: str | None = None,
    ) -> AsyncRolloutGroup:
        """Starts ``num_workers`` Ray actors (``num_cpus`` each) and waits until each has built its model."""
        import ray

        actor_cls = ray.remote(AsyncRolloutWorker)
        workers = [
            actor_cls.options(num_cpus=num_cpus, max_concurrency=4, name=None).remote(
                spec if i == 0 else _reseeded(spec, i)
            )
            for i in range(num_workers)
        ]
        ray.get([w.stats.remote() for w in workers])  # type: ignore[attr-defined]  # built, or raises
        return cls(workers, remote=True, weight_transport=weight_transport, weight_store_url=weight_store_url)

    @classmethod
    def local(cls, spec: RolloutWorkerSpec, *, num_workers: int = 1, **kwargs: Any) -> AsyncRolloutGroup:
        """Workers in this process (each its own generation thread)."""
        workers = [AsyncRolloutWorker(spec if i == 0 else _reseeded(spec, i)) for i in range(num_workers)]
        return cls(workers, remote=False, **kwargs)

    def _call(self, method: str, *args: Any, targets: Sequence[Any] | None = None) -> list[Any]:
        targets = self.workers if targets is None else targets
        if not self.remote:
            return [getattr(w, method)(*args) for w in targets]
        import ray

        return list(ray.get([getattr(w, method).remote(*args) for w in targets]))

    # ------------------------------------------------------------------------------------------- requests
    def submit(
        self, batch_id: int, prompts: DataProto, sampling: SamplingParams, *, n: int, min_version: int, front: bool
    ) -> int:
        """Splits ``prompts`` (groups of ``n`` adjacent rows) between the workers; returns the number of parts."""
        groups = len(prompts) // n
        parts = min(len(self.workers), groups)
        bounds = [round(i * groups / parts) * n for i in range(parts + 1)]
        for part in range(parts):
            chunk = prompts[list(range(bounds[part], bounds[part + 1]))]  # a copy of the rows
            self._call(
                "submit", f"{batch_id}/{part}", chunk, sampling, min_version, front, targets=[self.workers[part]]
            )
        return parts

    def poll(self, timeout_s: float) -> list[tuple[int, int, DataProto]]:
        """Finished parts ``(batch id, part, rows)`` of every worker, waiting up to ``timeout_s``."""
        found = []
        for results in self._call("poll", timeout_s):
            for request_id, data in results:
                batch_id, part = request_id.split("/")
                found.append((int(batch_id), int(part), data))
        return found

    def push_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Sends ``state`` (the actor's full weights after ``version`` updates) to every worker."""
        if self.weight_transport == "remote_store":
            from rlhf_ops.storage.stores import open_store

            assert self.weight_store_url is not None
            url = f"{self.weight_store_url.rstrip('/')}/policy_v{version}.safetensors"
            fs, path = open_store(url)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with fs.open(path, "wb") as f:
                f.write(write_weights(state))
            self._call("push_weights", url, version)  # each has read it when this returns
            if self._stored is not None and self._stored != url:
                old_fs, old_path = open_store(self._stored)
                old_fs.rm(old_path)
            self._stored = url
            return
        if self.remote:
            import ray

            self._call("push_weights", ray.put(state), version)  # one copy in the store, read by every worker
        else:
            self._call("push_weights", state, version)

    def stats(self) -> list[dict[str, float]]:
        return list(self._call("stats"))

    def shutdown(self) -> None:
        try:
            self._call("stop")
        finally:
            if self.remote:
                import ray

                for worker in self.workers:
                    ray.kill(worker)


def _reseeded(spec: RolloutWorkerSpec, index: int) -> RolloutWorkerSpec:
    import dataclasses

    return dataclasses.replace(spec, seed=spec.seed + 1000 * index)


def launch_for_run(
    config: Any, plan: Any, model_path: str, pad_token_id: int, eos_token_id: tuple[int, ...]
) -> AsyncRolloutGroup:
    """The rollout group of a ``trainer.pipeline=async`` run (``trainer.async_rollout``), as Ray actors."""
    a, t = config.trainer.async_rollout, config.trainer
    store = a.weight_store_url
    if a.weight_transport == "remote_store" and store is None:
        store = "/".join([t.remote_store_url.rstrip("/"), t.experiment_name, t.run_name, "rollout_weights"])
    spec = RolloutWorkerSpec(
        model_path=model_path,
        rollout=config.rollout,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        max_prompt_length=plan.max_prompt_length,
        seed=t.seed + 7777,
        num_threads=a.threads_per_worker,
        partial_rollout=a.partial_rollout,
        partial_rollout_tokens=a.partial_rollout_tokens,
        attn_implementation=config.model.attn_implementation,
    )
    return AsyncRolloutGroup.launch(
        spec,
        num_workers=a.num_workers,
        num_cpus=a.num_cpus_per_worker,
        weight_transport=a.weight_transport,
        weight_store_url=store,
    )
