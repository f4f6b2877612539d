"""``register``: the best checkpoint's HF export registered in MLflow; the champion alias decided (and moved,
unless an approval gate waits)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, RunRef, gpus_for, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class RegisterRequest(JobRequest):
    config: dict[str, Any]
    mlflow_run_id: str
    registered_name: str
    metric: str
    promotion: dict[str, Any] = Field(default_factory=dict)
    eval_n_samples: int
    eval_max_prompts: int
    move: bool = True
    engine: str = "auto"

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> RegisterRequest:
        """The run's config, MLflow run and registered name; the form's metric and promotion test.

        ``values["move"]`` False (the approval gate is on): the job decides and logs, and the alias waits for
        ``promote_champion`` after the approval.
        """
        return cls(
            run=run,
            config=values["config"],
            mlflow_run_id=values["mlflow_run_id"],
            registered_name=values["registered_name"],
            metric=params.eval_metric,
            promotion=params.promotion.model_dump(mode="json"),
            eval_n_samples=params.eval_n_samples,
            eval_max_prompts=params.eval_max_prompts,
            move=bool(values.get("move", True)),
            engine=params.eval_engine,
        )

    def num_gpus(self) -> float | None:
        return gpus_for(self.config)

    def event_extra(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """The ``registered_model`` event: name, version, URI, the best step and its metric."""
        keys = ("registered_name", "version", "model_uri", "best_step", "metric", "value", "summary")
        return {k: result.get(k) for k in keys} | {"mlflow_run_id": self.mlflow_run_id}


class RegisterResult(JobResult):
    registered_name: str | None = None
    promote: bool | None = None


@pipeline_job("register", request=RegisterRequest, result=RegisterResult, asset="registered_model")
def register(request: RegisterRequest) -> dict[str, Any]:
    """``rlhf_ops.pipeline.register.register_best``."""
    from rlhf_ops.pipeline.promotion import PromotionSpec
    from rlhf_ops.pipeline.register import register_best

    return register_best(
        request.run.layout(),
        config=request.config,
        mlflow_run_id=request.mlflow_run_id,
        registered_name=request.registered_name,
        metric=request.metric,
        promotion=PromotionSpec.model_validate(request.promotion),
        eval_n_samples=request.eval_n_samples,
        eval_max_prompts=request.eval_max_prompts,
        move=request.move,
        engine=request.engine,
    )
