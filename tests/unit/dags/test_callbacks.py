"""The failure summary's text from a task context (the integration test runs it inside a failing Airflow task)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_airflow.pipeline.callbacks import failure_summary, first_error_line


@dataclass
class TI:
    xcoms: dict[tuple[str, str], Any] = field(default_factory=dict)
    task_id: str = "evaluate.evaluate_checkpoint"
    map_index: int = 1
    dag_id: str = "rlhf_ppo"
    run_id: str = "manual__1"
    try_number: int = 3
    log_url: str = "http://af/dags/rlhf_ppo/runs/manual__1/tasks/evaluate.evaluate_checkpoint/mapped/1?try_number=3"

    def xcom_pull(self, *, task_ids: str, key: str) -> Any:
        return self.xcoms.get((task_ids, key))


def test_first_error_line() -> None:
    assert first_error_line(ValueError("\n  bad value\nTraceback ...")) == "ValueError: bad value"
    assert first_error_line(KeyError()) == "KeyError"
    assert first_error_line("x" * 400) == "x" * 300
    assert first_error_line(None).startswith("unknown error")


def test_summary_names_the_task_error_and_links() -> None:
    ti = TI(
        {("train", "ray_dashboard_url"): "http://ray/#/jobs/af-1", ("start_tracking", "mlflow_run_url"): "http://m/r"}
    )
    summary = failure_summary({"ti": ti, "exception": RuntimeError("CUDA out of memory\nmore")})
    assert summary["text"].splitlines() == [
        "rlhf_ppo / manual__1: evaluate.evaluate_checkpoint[1] failed (try 3)",
        "error: RuntimeError: CUDA out of memory",
        "Ray job: http://ray/#/jobs/af-1",
        "MLflow run: http://m/r",
        f"log: {ti.log_url}",
    ]
    bare = failure_summary({"ti": TI(map_index=-1, task_id="preflight"), "exception": None})
    assert bare["task"] == "preflight" and "Ray job" not in bare["text"] and bare["ray_job"] == ""


@dataclass
class Conn:
    host: str
    port: int | None = None
    schema: str = ""


def test_api_base_url_of_the_airflow_api_connection() -> None:
    from rlhf_airflow.pipeline.callbacks import api_base_url

    assert api_base_url(Conn("http://127.0.0.1:28780/")) == "http://127.0.0.1:28780"
    assert api_base_url(Conn("airflow-api", port=8080)) == "http://airflow-api:8080"
    assert api_base_url(Conn("af.example.com", schema="https")) == "https://af.example.com"
    assert api_base_url(Conn("https://af.example.com", port=8443)) == "https://af.example.com:8443"


def test_no_api_connection_writes_no_note() -> None:
    from rlhf_airflow.pipeline.callbacks import write_run_note

    assert write_run_note("rlhf_ppo", "manual__1", "summary", api_conn_id="not_defined_here") is False
    assert write_run_note("rlhf_ppo", "manual__1", "summary", api_conn_id=None) is False
