"""``rlhf_ppo``: the RLHF pipeline, triggered from the form (or the REST API) with one run's parameters.

prepare_data (Ray job) → preflight → start_tracking → train (Ray job) + evaluation of each checkpoint while it
trains (a Ray job each) → sync_and_retain → register_model (Ray job). The parameters (preset, model, data,
algorithm, steps, learning rate, KL, rollout n, remote store, overrides, Ray address…) are JSON-Schema
``Param``s: the form renders and checks them. The rest is in ``rlhf_airflow.pipeline.factory`` and
``docs/pipeline.md``.
"""

from __future__ import annotations

from airflow.sdk import DAG

from rlhf_airflow.pipeline.factory import build_pipeline_dag

dag: DAG = build_pipeline_dag(
    "rlhf_ppo",
    schedule=None,
    tags=["ppo", "grpo", "manual"],
    description="RLHF fine-tuning run (PPO/GRPO on Ray), triggered with a form",
    max_active_runs=4,
)
