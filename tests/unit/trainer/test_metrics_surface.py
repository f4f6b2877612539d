"""Driver-side metrics of the training surface: memory peaks reduce by max, profiler traces become artifacts."""

from __future__ import annotations

from pathlib import Path

from rlhf_ops.tracking.logger import JsonlLogger
from rlhf_ops.trainer.metrics import log_profile_traces, reduce_worker_metrics


def test_memory_peaks_take_the_max_over_ranks_other_metrics_the_mean() -> None:
    per_rank = [
        {"memory/actor/update_actor/peak_rss_gb": 1.0, "actor/pg_loss": 0.2},
        {"memory/actor/update_actor/peak_rss_gb": 3.0, "actor/pg_loss": 0.4},
    ]
    out = reduce_worker_metrics(per_rank)
    assert out["memory/actor/update_actor/peak_rss_gb"] == 3.0
    assert abs(out["actor/pg_loss"] - 0.3) < 1e-12


def test_profile_traces_of_the_step_are_logged_as_artifacts(tmp_path: Path) -> None:
    step_dir = tmp_path / "profiles" / "step_2"
    step_dir.mkdir(parents=True)
    (step_dir / "actor_update_actor_rank0.json").write_text('{"traceEvents": []}')
    (step_dir / "actor_generate_rank1.json").write_text('{"traceEvents": [1]}')
    (tmp_path / "profiles" / "step_3").mkdir()
    logger = JsonlLogger(tmp_path / "run" / "metrics.jsonl")
    logged = log_profile_traces(logger, str(tmp_path / "profiles"), step=2)
    assert logged == ["profiles/step_2/actor_generate_rank1.json", "profiles/step_2/actor_update_actor_rank0.json"]
    artifact = logger.artifact_dir / "profiles" / "step_2" / "actor_generate_rank1.json"
    assert artifact.read_text() == '{"traceEvents": [1]}'
    assert log_profile_traces(logger, str(tmp_path / "profiles"), step=3) == []
