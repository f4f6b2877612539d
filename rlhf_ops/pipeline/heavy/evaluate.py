"""``evaluate``: one committed checkpoint, exported and evaluated with the run's reward function."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, RunRef, gpus_for, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams

HEADLINE_METRICS = ("eval/acc", "eval/reward/mean", "eval/mean_acc", "eval/pass_at_4", "eval/num_prompts")


class EvaluateRequest(JobRequest):
    step: int
    location: str
    config: dict[str, Any]
    mlflow_run_id: str | None = None
    n_samples: int
    max_prompts: int
    engine: str = "auto"

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> EvaluateRequest:
        """``values["found"]`` is the sensor's checkpoint; the run's config and MLflow run; the form's settings."""
        found = values["found"]
        return cls(
            run=run,
            step=int(found["step"]),
            location=str(found["location"]),
            config=values["config"],
            mlflow_run_id=values["mlflow_run_id"],
            n_samples=params.eval_n_samples,
            max_prompts=params.eval_max_prompts,
            engine=params.eval_engine,
        )

    def num_gpus(self) -> float | None:
        return gpus_for(self.config)

    def event_extra(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """The ``checkpoint`` event: step, location, headline metrics."""
        headline = {k: v for k, v in result["metrics"].items() if k in HEADLINE_METRICS}
        extra = {"step": result["step"], "checkpoint": self.location, "metrics": headline}
        return extra | {"mlflow_run_id": self.mlflow_run_id}


class EvaluateResult(JobResult):
    step: int
    metrics: dict[str, Any]


@pipeline_job("evaluate", request=EvaluateRequest, result=EvaluateResult, asset="checkpoint")
def evaluate(request: EvaluateRequest) -> dict[str, Any]:
    """``rlhf_ops.pipeline.evaluate.evaluate_step`` on this node's copy of the checkpoint when it has one."""
    from rlhf_ops.pipeline.checkpoints import find_checkpoint
    from rlhf_ops.pipeline.evaluate import evaluate_step

    layout = request.run.layout()
    return evaluate_step(
        request.step,
        # The sensor found it on the remote store; this node's own copy, when it has one, saves the download.
        location=find_checkpoint(request.step, layout) or request.location,
        config=request.config,
        layout=layout,
        mlflow_run_id=request.mlflow_run_id,
        n_samples=request.n_samples,
        max_prompts=request.max_prompts,
        engine=request.engine,
    )
