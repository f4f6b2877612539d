"""``retain``: final sync to the remote store, then keep the last ``keep_last`` checkpoints and the best (on the
cluster, where the local run folder is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, RunRef, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class RetainRequest(JobRequest):
    keep_last: int
    metric: str
    promotion: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> RetainRequest:
        """The form's ``keep_last``, metric and promotion test."""
        return cls(
            run=run,
            keep_last=params.keep_last,
            metric=params.eval_metric,
            promotion=params.promotion.model_dump(mode="json"),
        )


class RetainResult(JobResult):
    best_step: int | None = None


@pipeline_job("retain", request=RetainRequest, result=RetainResult)
def retain(request: RetainRequest) -> dict[str, Any]:
    """``rlhf_ops.pipeline.retention.sync_and_retain``."""
    from rlhf_ops.pipeline.promotion import PromotionSpec
    from rlhf_ops.pipeline.retention import sync_and_retain

    return sync_and_retain(
        request.run.layout(),
        keep_last=request.keep_last,
        metric=request.metric,
        promotion=PromotionSpec.model_validate(request.promotion),
    )
