"""Runs the reliability and security suite (``tests/reliability``) and prints its figures.

Every case records what it measured (fuzzed values refused / accepted, rows accounted for, kills survived and
processes left alive, lost / repeated steps, storage faults injected, secrets found) into a JSON file per case;
this script runs pytest with ``RLHF_RELIABILITY_OUT`` pointing at a folder, then prints one table.

    .venv/bin/python bench/reliability_report.py                # the default cases (~7 minutes on 2 cores, estimated)
    .venv/bin/python bench/reliability_report.py --slow         # plus the slow ones (3000 fuzzed values,
                                                                #  100 faulty syncs, kill + resume of rlhf train,
                                                                #  kills of one worker rank and of the Ray head,
                                                                #  MLflow killed under rlhf train, the Airflow
                                                                #  triggerer / worker killed under a real DAG run,
                                                                #  1, 2 and 4 pipeline runs at once)
    .venv/bin/python bench/reliability_report.py --from DIR     # print figures recorded earlier
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (case file prefix, figure, label) in report order.
ROWS = [
    ("test_config_fuzz.", "cases", "config: fuzzed (key, bad value) cases"),
    ("test_config_fuzz.", "keys", "config: schema keys fuzzed"),
    ("test_config_fuzz.", "refused", "config: refused, one line naming the key"),
    ("test_config_fuzz.", "accepted", "config: accepted (valid for the key)"),
    ("test_config_fuzz.", "crashes", "config: crashes"),
    ("test_config_fuzz.", "bad_messages", "config: refusals not one line / not naming the key"),
    ("test_hostile_rows.", "rows", "prepare-data: hostile JSONL lines"),
    ("test_hostile_rows.", "accepted", "prepare-data: accepted"),
    ("test_hostile_rows.", "rejected", "prepare-data: rejected with the expected kind"),
    ("test_hostile_rows.", "blank", "prepare-data: blank"),
    ("test_path_components.", "names", "hostile experiment / run names"),
    ("test_path_components.", "names_refused", "names refused by the config"),
    ("test_path_components.", "files_outside_root", "files written outside their root"),
    ("test_who_may_do_what.", "hostile_overrides", "form overrides outside the allowed set"),
    ("test_who_may_do_what.", "refused", "form overrides refused at preflight"),
    ("test_who_may_do_what.", "refused_modules", "reward modules refused (not on the allow-list)"),
    ("test_secrets.", "occurrences", "secrets found in the MLflow store (params, tags, artifacts)"),
    ("test_secrets_pipeline.", "occurrences", "secrets found after a pipeline run (MLflow, XCom, logs, ckpts)"),
    ("test_storage_faults.", "syncs", "S3 syncs under faults"),
    ("test_storage_faults.", "faults_injected", "S3 faults injected (500 / 503 / reset, slow answers)"),
    ("test_storage_faults.", "succeeded", "S3 syncs that completed"),
    ("test_storage_faults.", "failed_cleanly", "S3 syncs that failed cleanly (SyncError, no manifest)"),
    ("test_storage_faults.", "checkpoint_without_manifest_seen", "remote checkpoint seen without its manifest"),
    ("test_storage_faults.", "worst_sync_s", "slowest sync (s; retries bounded)"),
    ("test_storage_faults.", "disk_full_saves", "disk-full saves: previous checkpoint and latest kept"),
    ("test_kill.", "kills", "SIGKILL of a run's process group"),
    ("test_kill.", "alive_after_kill", "processes of the killed run alive after the bound (5 s)"),
    ("test_kill.", "seconds_to_clean", "seconds until none was left"),
    ("test_kill.", "lost_steps", "optimizer steps lost after kill + resume"),
    ("test_kill.", "repeated_steps", "optimizer steps repeated after kill + resume"),
    ("test_kill_upload.", "upload_kills", "SIGKILL of rlhf sync mid-upload (moto S3)"),
    ("test_kill_upload.", "files_up_at_kill", "files of the half-uploaded checkpoint on the remote at the kill"),
    ("test_kill_upload.", "upload_checkpoint_without_manifest_seen", "remote checkpoint seen without its manifest"),
    ("test_kill_upload.", "completed_after_resync", "checkpoints complete (hashes verified) after the next sync"),
    ("test_mlflow_outage.", "mlflow_kills", "SIGKILL of the MLflow server while metrics are logged"),
    ("test_mlflow_outage.", "mlflow_steps_logged_during_outage", "MLflow: steps logged while it was down"),
    ("test_mlflow_outage.", "mlflow_longest_log_wait_seconds", "MLflow: longest log_metrics call while down (s)"),
    ("test_mlflow_outage.", "mlflow_outage_seconds", "MLflow: seconds from the first failed send to the next"),
    ("test_mlflow_outage.", "mlflow_values_sent", "MLflow: metric values in MLflow after the restart"),
    ("test_mlflow_outage.", "mlflow_values_lost", "MLflow: metric values lost"),
    ("test_mlflow_outage.", "train_mlflow_kills", "SIGKILL of the MLflow server during rlhf train"),
    ("test_mlflow_outage.", "train_steps_while_mlflow_down", "rlhf train: steps trained while MLflow was down"),
    ("test_mlflow_outage.", "train_mlflow_down_seconds", "rlhf train: seconds MLflow was down"),
    ("test_mlflow_outage.", "train_values_checked", "rlhf train: metric values compared with metrics.jsonl"),
    ("test_mlflow_outage.", "train_values_missing", "rlhf train: values missing from MLflow"),
    ("test_mlflow_outage.", "train_values_different", "rlhf train: values different in MLflow"),
    ("test_orchestrator_kill.", "orchestrator_kills", "SIGKILL of the process running train's operator / trigger"),
    ("test_orchestrator_kill.", "orchestrator_second_jobs", "second Ray jobs submitted after those kills"),
    ("test_orchestrator_kill.", "orchestrator_tasks_succeeded", "tasks that ended with the job's result"),
]
# The slow concurrent pipeline runs (tests/reliability/test_concurrent_runs.py): 1, 2 and 4 rlhf_ppo runs at once.
ROWS += [
    ("test_concurrent_runs.", "concurrent_1_wall_seconds", "concurrent runs: wall time of one run alone (s)"),
    ("test_concurrent_runs.", "concurrent_2_wall_seconds", "2 runs at once: wall time (s)"),
    ("test_concurrent_runs.", "concurrent_2_vs_one", "2 runs at once: wall time / one run alone"),
    ("test_concurrent_runs.", "concurrent_2_jobs_overlap_seconds", "2 runs at once: seconds both Ray jobs ran"),
    ("test_concurrent_runs.", "concurrent_2_cross_run_files", "2 runs at once: files of one run in another's"),
    ("test_concurrent_runs.", "concurrent_4_wall_seconds", "4 runs at once: wall time (s)"),
    ("test_concurrent_runs.", "concurrent_4_vs_one", "4 runs at once: wall time / one run alone"),
    ("test_concurrent_runs.", "concurrent_4_jobs_overlap_seconds", "4 runs at once: seconds all 4 Ray jobs ran"),
    ("test_concurrent_runs.", "concurrent_4_cross_run_files", "4 runs at once: files of one run in another's"),
    ("test_concurrent_runs.", "latency_max_seconds_ray", "4 runs at once: slowest Ray job server answer (s)"),
    ("test_concurrent_runs.", "latency_max_seconds_mlflow", "4 runs at once: slowest MLflow server answer (s)"),
    ("test_concurrent_runs.", "latency_samples", "4 runs at once: server answers timed (1 / s each)"),
    ("test_concurrent_runs.", "latency_failures", "4 runs at once: server requests that failed"),
]
# The slow real-Airflow kills (tests/reliability/test_orchestrator_kill.py): the triggerer, a LocalExecutor worker.
for _dag, _what in (("kill_triggerer", "the Airflow triggerer"), ("kill_worker", "the Airflow worker")):
    ROWS += [
        ("test_orchestrator_kill.", f"{_dag}_kills", f"SIGKILL of {_what} while train runs"),
        ("test_orchestrator_kill.", f"{_dag}_try_number", f"{_what}: the try that succeeded"),
        ("test_orchestrator_kill.", f"{_dag}_seconds_to_success", f"{_what}: seconds from the kill to success"),
        ("test_orchestrator_kill.", f"{_dag}_jobs_for_the_task", f"{_what}: Ray jobs for the task"),
    ]
ROWS.append(("test_orchestrator_kill.", "kill_worker_retry_found_the_job_running", "the retry found the job running"))
# The slow Ray kills (tests/reliability/test_kill_ray.py): one worker rank's actor process, the Ray head's GCS.
for _target, _what in (("worker_rank", "one worker rank"), ("ray_head", "the Ray head (GCS)")):
    ROWS += [
        ("test_kill_ray.", f"{_target}_kills", f"SIGKILL of {_what} of a 2-rank rlhf train"),
        ("test_kill_ray.", f"{_target}_seconds_to_fail", f"{_what}: seconds until the driver failed"),
        ("test_kill_ray.", f"{_target}_seconds_to_clean", f"{_what}: seconds until no process of the run was left"),
        ("test_kill_ray.", f"{_target}_lost_steps", f"{_what}: optimizer steps lost after resume"),
        ("test_kill_ray.", f"{_target}_repeated_steps", f"{_what}: optimizer steps repeated after resume"),
        ("test_kill_ray.", f"{_target}_metric_differences", f"{_what}: steps whose metrics differ from a clean run"),
    ]


def run_suite(out: Path, *, slow: bool) -> int:
    env = {**os.environ, "RLHF_RELIABILITY_OUT": str(out), "PYTHONPATH": str(ROOT)}
    if slow:
        env["RLHF_TEST_SLOW"] = "1"
    marker = [] if slow else ["-m", "not slow"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marker, "tests/reliability"]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


def load(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def table(cases: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """``(label, value)`` per figure; figures of several cases of a kind (e.g. default + slow) are summed."""
    lines = []
    for prefix, key, label in ROWS:
        values = [fig[key] for case, fig in cases.items() if case.startswith(prefix) and key in fig]
        if not values:
            continue
        value = max(values) if key.startswith("worst") or "seconds" in key else sum(values)
        lines.append((label, f"{value:g}" if isinstance(value, float) else str(value)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", action="store_true", help="also run the slow cases")
    parser.add_argument("--from", dest="source", type=Path, help="print the figures recorded in this folder")
    args = parser.parse_args(argv)
    rc = 0
    if args.source is None:
        out = Path(tempfile.mkdtemp(prefix="rlhf-reliability-"))
        rc = run_suite(out, slow=args.slow)
    else:
        out = args.source
    rows = table(load(out))
    width = max((len(label) for label, _ in rows), default=10)
    print(f"\nreliability figures ({out}):")
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    if rc:
        print(f"pytest exited {rc}: a case failed (its figures may be missing)")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
