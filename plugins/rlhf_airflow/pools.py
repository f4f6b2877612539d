"""The Airflow pool that stands for the Ray cluster's capacity: ``train`` and each ``evaluate_checkpoint`` take slots.

A spec's ``pool`` (all keys optional)::

    pool:
      name: rlhf_cluster      # the Airflow pool (shared by every pipeline that names it)
      slots: 4                # its size when this platform creates it (tests, the demo, airflow-init)
      train_slots: 1          # slots the training job holds for its whole run (it defers: see below)
      eval_slots: 1           # slots each checkpoint evaluation holds

Airflow never creates a pool a task names, and the scheduler does not schedule a task whose pool is missing,
so a deployment creates it once::

    airflow pools set rlhf_cluster 4 "Ray cluster capacity of the RLHF pipelines" --include-deferred

``--include-deferred`` matters: ``train`` is deferrable and spends the run deferred, which frees its slots
unless the pool counts deferred tasks. :func:`ensure_pools` does the same for the tests and the demo (it leaves
an existing pool's size alone). ``dag.test()`` ignores pools.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_POOL_NAME = "rlhf_cluster"
DEFAULT_POOL_SLOTS = 4
POOL_KEYS = frozenset({"name", "slots", "train_slots", "eval_slots"})
DESCRIPTION = "Ray cluster capacity of the RLHF pipelines (train and evaluate tasks); created by rlhf-ops"


@dataclass(frozen=True, kw_only=True)
class ClusterPool:
    """The pool the heavy tasks of a pipeline run in, and how many slots each takes."""

    name: str = DEFAULT_POOL_NAME
    slots: int = DEFAULT_POOL_SLOTS
    train_slots: int = 1
    eval_slots: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 256:
            raise ValueError(f"pool.name must be a non-empty string of at most 256 characters, got {self.name!r}")
        for key in ("slots", "train_slots", "eval_slots"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pool.{key} must be a positive integer, got {value!r}")
        for key in ("train_slots", "eval_slots"):
            if getattr(self, key) > self.slots:
                raise ValueError(
                    f"pool.{key}={getattr(self, key)} exceeds pool.slots={self.slots}: the task would never be "
                    "scheduled; raise pool.slots or lower the task's slots"
                )


def cluster_pool(spec: ClusterPool | Mapping[str, Any] | None) -> ClusterPool:
    """A :class:`ClusterPool` from a spec's ``pool`` mapping (None: the defaults).

    Raises:
        ValueError: an unknown key or a bad value, named in the message.
    """
    if isinstance(spec, ClusterPool):
        return spec
    spec = dict(spec or {})
    unknown = sorted(set(spec) - POOL_KEYS)
    if unknown:
        raise ValueError(f"unknown pool key(s) {unknown}; valid: {sorted(POOL_KEYS)}")
    return ClusterPool(**spec)


def pools_of(dags: Iterable[Any]) -> dict[str, int]:
    """``{pool name: slots to create it with}`` of the cluster pools the pipeline DAGs' tasks name.

    The size is the largest ``slots`` any pipeline declared for that name (``build_pipeline_dag`` records it on
    the DAG's ``rlhf_cluster_pool`` attribute).
    """
    sizes: dict[str, int] = {}
    for dag in dags:
        pool = getattr(dag, "rlhf_cluster_pool", None)
        if isinstance(pool, ClusterPool):
            sizes[pool.name] = max(sizes.get(pool.name, 0), pool.slots)
    return sizes


def ensure_pools(pools: Mapping[str, int], *, include_deferred: bool = True) -> list[str]:
    """Create each missing pool (``{name: slots}``) in the metadata DB; returns the names it created."""
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    created = []
    with create_session() as session:
        for name, slots in sorted(pools.items()):
            if Pool.get_pool(name, session=session) is None:
                Pool.create_or_update_pool(
                    name, slots, DESCRIPTION, include_deferred=include_deferred, session=session
                )
                created.append(name)
    return created
