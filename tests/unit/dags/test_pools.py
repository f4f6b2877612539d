"""The cluster pool the pipelines name, created in a real (SQLite) Airflow metadata DB when missing."""

from __future__ import annotations

from pathlib import Path

from tests.support.airflow_env import migrate_airflow_db

DAGS = Path(__file__).resolve().parents[3] / "dags"


def test_pools_of_the_dags_folder_and_ensure_pools_creates_only_missing_ones() -> None:
    migrate_airflow_db()
    from airflow.dag_processing.dagbag import BundleDagBag
    from airflow.models.pool import Pool

    from rlhf_airflow.pools import ensure_pools, pools_of

    bag = BundleDagBag(dag_folder=str(DAGS), bundle_path=str(DAGS), bundle_name="dags-folder")
    # rlhf_ppo and the weekly spec share the default pool; the GPU spec names its own
    assert pools_of(bag.dags.values()) == {"rlhf_cluster": 4, "gpu_cluster": 16}
    # The metadata DB is shared by the session's tests: earlier pipeline runs may have made rlhf_cluster already.
    if Pool.get_pool("rlhf_cluster") is not None:
        Pool.delete_pool("rlhf_cluster")
    Pool.create_or_update_pool("gpu_cluster", 32, "sized by the deployer", include_deferred=False)
    created = ensure_pools(pools_of(bag.dags.values()))
    assert created == ["rlhf_cluster"]
    cluster, gpu = Pool.get_pool("rlhf_cluster"), Pool.get_pool("gpu_cluster")
    assert cluster is not None and gpu is not None
    assert (cluster.slots, cluster.include_deferred) == (4, True)  # train defers: its slots must stay held
    assert gpu.slots == 32  # an existing pool keeps the deployer's size
    assert ensure_pools({"rlhf_cluster": 4}) == []
