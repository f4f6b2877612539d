"""``prepare_data``: raw data -> train/val Parquet, rejected rows and the manifest, in the run's folder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, RunRef, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class PrepareDataRequest(JobRequest):
    params: dict[str, Any]
    """The trigger form's values (``PipelineParams`` as JSON)."""
    override_policy: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> PrepareDataRequest:
        """The form's values, the run, the DAG's override policy (``values["override_policy"]``)."""
        policy = dict(values.get("override_policy") or {})
        return cls(run=run, params=params.model_dump(mode="json"), override_policy=policy)

    def event_extra(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """The ``prepared_data`` event: where the files are and how many rows each holds."""
        from rlhf_ops.pipeline.layout import run_key

        keys = ("run_url", "train_url", "val_url", "num_train", "num_val", "num_rejected", "manifest_url")
        return {k: result.get(k) for k in keys} | {"airflow_run_id": run_key(self.run.run_id)}


class PrepareDataResult(JobResult):
    train_url: str
    val_url: str
    num_train: int
    num_val: int
    num_rejected: int
    manifest_url: str
    manifest: dict[str, Any] = Field(default_factory=dict)
    """The data manifest itself, so ``start_tracking`` logs it without reading the job's folder."""
    rejected_sample: list[dict[str, Any]] = Field(default_factory=list)


@pipeline_job("prepare_data", request=PrepareDataRequest, result=PrepareDataResult, asset="prepared_data")
def prepare_data(request: PrepareDataRequest) -> dict[str, Any]:
    """Prepare the run's data (``rlhf_ops.pipeline.data.prepare_for_run``); the manifest travels with the result."""
    from rlhf_ops.pipeline.data import prepare_for_run
    from rlhf_ops.pipeline.params import parse_params
    from rlhf_ops.pipeline.tracking import MAX_REJECTED_SAMPLE, read_json, read_jsonl_head

    prepared = prepare_for_run(
        parse_params(request.params), request.run.layout(), override_policy=request.override_policy
    )
    prepared["manifest"] = read_json(str(prepared["manifest_url"]))
    prepared["rejected_sample"] = read_jsonl_head(str(prepared["rejected_url"]), MAX_REJECTED_SAMPLE)
    return prepared
