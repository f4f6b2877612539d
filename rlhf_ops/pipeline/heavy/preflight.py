"""``preflight``: resolve and validate the config, check what the run needs where its files and code are (the
cluster), plan the checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, RunRef, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class PreflightRequest(JobRequest):
    params: dict[str, Any]
    prepared: dict[str, Any]
    model_path: str | None = None
    """The champion's model folder for a warm start (``fetch_champion``'s result)."""
    override_policy: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> PreflightRequest:
        """``values["prepared"]`` is ``prepare_data``'s result; ``values["champion"]`` is ``fetch_champion``'s (None:
        skipped, the run starts from scratch), whose model folder becomes ``model.path``."""
        champion = values.get("champion") or {}
        return cls(
            run=run,
            params=params.model_dump(mode="json"),
            prepared=dict(values["prepared"]),
            model_path=champion.get("model_dir") if params.warm_start == "champion" else None,
            override_policy=dict(values.get("override_policy") or {}),
        )


class PreflightResult(JobResult):
    config: dict[str, Any]
    entrypoint: str
    checkpoint_steps: list[int]
    layout: dict[str, Any]
    checkpoint_url: str
    registered_model_name: str


@pipeline_job("preflight", request=PreflightRequest, result=PreflightResult)
def preflight(request: PreflightRequest) -> dict[str, Any]:
    """``rlhf_ops.pipeline.preflight.run_preflight``; a config problem is one line per problem, as ``rlhf train``."""
    from rlhf_ops.config import ConfigError
    from rlhf_ops.pipeline.params import parse_params
    from rlhf_ops.pipeline.preflight import run_preflight

    try:
        return run_preflight(
            parse_params(request.params),
            request.run.layout(),
            request.prepared,
            model_path=request.model_path,
            override_policy=request.override_policy,
        )
    except ConfigError as exc:  # one line per problem, as `rlhf train` prints them
        raise ValueError("; ".join(str(p) for p in exc.problems) or str(exc)) from None
