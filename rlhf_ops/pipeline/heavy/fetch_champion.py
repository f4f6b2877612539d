"""``fetch_champion``: the registered champion's model folder, for a run that warm-starts from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, JobSkipped, RunRef, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class FetchChampionRequest(JobRequest):
    registered_name: str

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> FetchChampionRequest:
        """The pipeline's registered model; skipped unless the run warm-starts from the champion."""
        if params.warm_start != "champion":
            raise JobSkipped(f"warm_start is {params.warm_start!r}: no champion to fetch")
        return cls(run=run, registered_name=params.registered_name(run.dag_id))


class FetchChampionResult(JobResult):
    model_dir: str | None = None


@pipeline_job("fetch_champion", request=FetchChampionRequest, result=FetchChampionResult)
def fetch_champion(request: FetchChampionRequest) -> dict[str, Any]:
    """Download the champion into the run's models folder (``rlhf_ops.pipeline.register.fetch_champion``)."""
    from rlhf_ops.pipeline.register import fetch_champion as fetch

    return fetch(request.registered_name, models_dir=request.run.layout().models_dir)
