"""Two runs of one pipeline at once, with different params: every name and path they derive is their own.

The cheap default-suite half of ``tests/reliability/test_concurrent_runs.py`` (slow: the real pipelines, two and
four at once). Here: two Airflow run ids triggered in the same second, each with its own seed and learning rate,
through the same derivations the tasks use (``RunLayout``, the preflight's resolved config, the Ray submission
id, the MLflow run name), under one shared work folder and one remote store.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from rlhf_airflow.operators import derive_submission_id
from rlhf_ops.pipeline.layout import RunLayout, run_key
from rlhf_ops.pipeline.params import parse_params, train_entrypoint
from rlhf_ops.pipeline.preflight import resolve_run_config
from rlhf_ops.tracking.mlflow_tracking import run_name_for

# What the REST API makes of two triggers in the same second (microseconds tell them apart).
RUN_IDS = ("manual__2026-12-02T17:00:00.104211+00:00", "manual__2026-12-02T17:00:00.391077+00:00")
CONFS = (
    {"learning_rate": 2e-3, "overrides": ["trainer.seed=1"], "remote_store_url": "s3://bucket/runs"},
    {"learning_rate": 5e-4, "overrides": ["trainer.seed=2"], "remote_store_url": "s3://bucket/runs"},
)
STARTED = dt.datetime(2026, 12, 2, 17, 0, tzinfo=dt.UTC)  # both in the same minute


def _derive(tmp_path: Path, run_id: str, conf: dict[str, Any]) -> dict[str, Any]:
    params = parse_params({"preset": "tiny-cpu", "work_dir": str(tmp_path), **conf})
    layout = RunLayout.for_run(
        dag_id="rlhf_ppo", run_id=run_id, work_dir=params.work_dir, remote_store_url=params.remote_store_url
    )
    data_dir = Path(layout.data_root) / layout.run_key  # prepare_data's out_url/<run_key>
    prepared = {"train_url": str(data_dir / "train.parquet"), "val_url": str(data_dir / "val.parquet"), "num_val": 8}
    config, overrides = resolve_run_config(params, layout, prepared)
    return {
        "layout": layout,
        "data_dir": data_dir,
        "config": config,
        "entrypoint": train_entrypoint(params.preset, overrides),
        "submission_id": derive_submission_id(dag_id="rlhf_ppo", run_id=run_id, task_id="train"),
        "mlflow_name": run_name_for("tiny-cpu", "grpo", STARTED, key=run_key(run_id).rsplit("-", 1)[-1]),
    }


def test_two_runs_at_once_derive_disjoint_folders_ids_and_configs(tmp_path: Path) -> None:
    a, b = (_derive(tmp_path, run_id, conf) for run_id, conf in zip(RUN_IDS, CONFS, strict=True))
    la, lb = a["layout"], b["layout"]
    # The run ids differ only after the seconds; their keys keep them apart (the digest).
    assert la.run_key != lb.run_key and la.run_key.startswith("manual__2026-12-02T17-00-00.104211-00-00-")
    folders = {name: (Path(getattr(la, name)), Path(getattr(lb, name))) for name in ("local_run_dir", "cache_dir")} | {
        "data": (a["data_dir"], b["data_dir"])
    }
    for name, (fa, fb) in folders.items():
        # Disjoint: neither folder is inside the other, and each lies under the shared work folder.
        assert fa != fb and not fa.is_relative_to(fb) and not fb.is_relative_to(fa), name
        assert fa.is_relative_to(tmp_path) and fb.is_relative_to(tmp_path), name
        assert la.run_key in str(fa) and lb.run_key in str(fb) and lb.run_key not in str(fa), name
    assert (la.remote_run_url, lb.remote_run_url) == (
        f"s3://bucket/runs/rlhf_ppo/{la.run_key}",
        f"s3://bucket/runs/rlhf_ppo/{lb.run_key}",
    )
    # Each resolved config trains its own run: its own run folder name, seed and learning rate.
    ca, cb = a["config"], b["config"]
    assert (ca.trainer.run_name, ca.trainer.seed, ca.actor.optim.lr) == (la.run_key, 1, 2e-3)
    assert (cb.trainer.run_name, cb.trainer.seed, cb.actor.optim.lr) == (lb.run_key, 2, 5e-4)
    assert ca.data.train_files == [str(a["data_dir"] / "train.parquet")]
    assert lb.run_key not in a["entrypoint"] and la.run_key not in b["entrypoint"]
    # One Ray job each, and MLflow runs told apart by name although they started in the same minute.
    assert a["submission_id"] != b["submission_id"]
    assert a["mlflow_name"] != b["mlflow_name"]
    assert a["mlflow_name"].startswith("tiny-cpu/grpo/2026-12-02T17:00/")
