"""``RayResourcePool``: the placement-group bundles that one or more worker groups run on.

One bundle per process (rank): ``{"CPU": num_cpus_per_process}`` plus ``{"GPU": 1}`` with
``use_gpu``. ``process_on_nodes=[n_0, n_1, ...]`` asks for ``n_i`` processes on node ``i``.

How a cluster maps to it:

- One machine with 8 GPUs: ``RayResourcePool([8], use_gpu=True)``: one STRICT_PACK placement
  group of 8 bundles; ranks 0-7, local ranks 0-7.
- Two machines with 8 GPUs each: ``RayResourcePool([8, 8], use_gpu=True)``: one STRICT_SPREAD
  placement group of one bundle per entry (``{"GPU": 8, "CPU": 8 * cpus}``), so each entry is on
  its own node (Ray picks which); ranks 0-7 share the first node's bundle, 8-15 the second's, local
  ranks restart at 0 on each node; the master address is rank 0's node IP. ``strategy="PACK"``
  instead makes one placement group of 16 bundles that Ray may place on any nodes; local ranks are
  then read from the placement-group table.
- This 2-core test machine: ``RayResourcePool([2], use_gpu=False, num_cpus_per_process=1)``.

Colocation: several worker groups share the same bundles (verl's "hybrid engine" placement) by
each requesting a fraction of every bundle (``RayWorkerGroup(resource_share=1/k)``), so two
roles of 2 ranks fit on 2 CPUs (0.5 CPU per actor). Bundles are reserved lazily on the first
:meth:`RayResourcePool.acquire` and released when the last group holding them shuts down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

__all__ = ["BundleSlot", "RayResourcePool"]

_log = logging.getLogger(__name__)
_NOTICE_S = 5.0  # a pool not granted within this long is waiting for other runs: logged once


@dataclass(frozen=True, kw_only=True)
class BundleSlot:
    """Where rank ``rank`` of a worker group runs."""

    rank: int
    """Global rank (position of the bundle in the pool)."""
    placement_group: PlacementGroup
    """The placement group holding the bundle."""
    bundle_index: int
    """Index of the bundle inside ``placement_group``."""
    node_id: str
    """Ray node id of the bundle's node."""
    local_rank: int
    """Index of this bundle among the pool's bundles on the same node."""


class RayResourcePool:
    """Placement-group bundles for ``sum(process_on_nodes)`` ranks, shared by colocated groups.

    Args:
        process_on_nodes: Number of processes (ranks) per node, e.g. ``[8, 8]``.
        use_gpu: Reserve GPUs: ``gpus_per_process`` per process.
        gpus_per_process: GPU share of one process with ``use_gpu``; below 1, ``1 / gpus_per_process``
            processes share a GPU (Ray fractional GPUs: each sees the same one device).
        num_cpus_per_process: CPUs per bundle; fractional values are allowed.
        name_prefix: Prefix of the placement-group names (shown in ``ray status``).
        strategy: ``"STRICT_PACK"``: one placement group per node entry, each forced onto one node.
            ``"PACK"``: one placement group for all bundles, packed onto as few nodes as possible.
        ready_timeout_s: How long to wait for the cluster to grant the bundles.
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        *,
        use_gpu: bool,
        num_cpus_per_process: float = 1.0,
        gpus_per_process: float = 1.0,
        name_prefix: str = "rlhf",
        strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK",
        ready_timeout_s: float = 60.0,
    ) -> None:
        if not process_on_nodes or any(n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes={process_on_nodes} must be a non-empty list of positive counts.")
        if num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process={num_cpus_per_process} must be > 0 (fractions like 0.5 are fine).")
        if strategy not in ("STRICT_PACK", "PACK"):
            raise ValueError(f"strategy={strategy!r} must be 'STRICT_PACK' or 'PACK'.")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        if not 0 < gpus_per_process <= 1:
            raise ValueError(f"gpus_per_process={gpus_per_process} must be in (0, 1] (0.5: two ranks per GPU).")
        self.num_cpus_per_process = num_cpus_per_process
        self.gpus_per_process = gpus_per_process
        self.name_prefix = name_prefix
        self.strategy = strategy
        self.ready_timeout_s = ready_timeout_s
        self._placement_groups: list[PlacementGroup] = []
        self._slots: list[BundleSlot] = []
        self._holders: set[int] = set()

    @property
    def world_size(self) -> int:
        """Number of bundles (ranks) in the pool."""
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one bundle."""
        return {"CPU": self.num_cpus_per_process, **({"GPU": self.gpus_per_process} if self.use_gpu else {})}

    def acquire(self, holder: object) -> list[BundleSlot]:
        """Reserve the bundles (first holder only) and register ``holder``; return one slot per rank.

        Raises:
            TimeoutError: If the cluster cannot grant the bundles within ``ready_timeout_s``.
        """
        if not self._placement_groups:
            self._reserve()
        self._holders.add(id(holder))
        return list(self._slots)

    def release(self, holder: object) -> None:
        """Unregister ``holder``; remove the placement groups once no holder is left."""
        self._holders.discard(id(holder))
        if not self._holders:
            self.shutdown()

    def shutdown(self) -> None:
        """Remove the placement groups (kills any actor still in them). Idempotent."""
        pgs, self._placement_groups, self._slots = self._placement_groups, [], []
        self._holders.clear()
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray is shut down: nothing left to free
                pass

    def __enter__(self) -> RayResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _node_bundles(self) -> list[dict[str, float]]:
        """One bundle per node entry holding all its processes' resources (the multi-node STRICT_PACK layout)."""
        return [{k: v * n for k, v in self.bundle.items()} for n in self.process_on_nodes]

    def _reserve(self) -> None:
        counts = self.process_on_nodes if self.strategy == "STRICT_PACK" else [self.world_size]
        if self.strategy == "STRICT_PACK" and len(self.process_on_nodes) > 1:
            # Several nodes: one STRICT_PACK group per node entry would let Ray put two entries on one node when it
            # has room. One STRICT_SPREAD group of one bundle per node puts each entry on its own
            # node; the node's ranks share its bundle (each actor asks for one process's part of it).
            pgs = [placement_group(self._node_bundles(), strategy="STRICT_SPREAD", name=f"{self.name_prefix}_pg0")]
            ranks_per_bundle = list(self.process_on_nodes)
        else:
            pgs = [
                placement_group(
                    [dict(self.bundle) for _ in range(n)], strategy=self.strategy, name=f"{self.name_prefix}_pg{i}"
                )
                for i, n in enumerate(counts)
            ]
            ranks_per_bundle = [1] * self.world_size
        self._placement_groups = pgs
        deadline = time.monotonic() + self.ready_timeout_s
        for pg in pgs:
            if pg.wait(timeout_seconds=min(_NOTICE_S, self.ready_timeout_s)):
                continue
            # Other runs may hold the cluster: say so once, then wait the rest of the timeout for them to finish.
            _log.warning(
                "resource pool %r: waiting up to %.0f s for %s bundles of %s (the cluster has %s free; other runs "
                "may hold it)",
                self.name_prefix,
                max(0.0, deadline - time.monotonic()),
                counts,
                self.bundle,
                ray.available_resources(),
            )
            if not pg.wait(timeout_seconds=max(0.0, deadline - time.monotonic())):
                self.shutdown()
                raise TimeoutError(
                    f"resource pool {self.name_prefix!r} could not reserve {counts} bundles of {self.bundle} within "
                    f"{self.ready_timeout_s}s; the cluster has {ray.available_resources()} free. Lower "
                    "process_on_nodes or num_cpus_per_process, add nodes, or raise resources.placement_timeout_s "
                    "when other runs hold the cluster."
                )
        self._slots = self._compute_slots(pgs, ranks_per_bundle)
        nodes = [slot.node_id for slot in self._slots]
        _log.info(
            "resource pool %r: %d rank(s) on %d node(s); rank -> node: %s",
            self.name_prefix,
            len(nodes),
            len(set(nodes)),
            ", ".join(f"{slot.rank}:{slot.node_id}" for slot in self._slots),
        )

    @staticmethod
    def _compute_slots(pgs: list[PlacementGroup], ranks_per_bundle: list[int]) -> list[BundleSlot]:
        """One slot per rank, in bundle order; ``ranks_per_bundle`` lists how many ranks share each bundle."""
        slots: list[BundleSlot] = []
        per_node: dict[str, int] = {}
        shares = iter(ranks_per_bundle)
        for pg in pgs:
            table: dict[str, Any] = placement_group_table(pg)
            bundle_nodes: dict[int, str] = table["bundles_to_node_id"]
            for index in range(pg.bundle_count):
                node = bundle_nodes[index]
                for _ in range(next(shares)):
                    local_rank = per_node.get(node, 0)
                    per_node[node] = local_rank + 1
                    slot = BundleSlot(
                        rank=len(slots), placement_group=pg, bundle_index=index, node_id=node, local_rank=local_rank
                    )
                    slots.append(slot)
        return slots
