"""The heavy jobs' runners (Ray side): each turns its typed request into the library call the task makes.

Named by dotted path in :data:`rlhf_ops.pipeline.job_requests.JOBS`; each imports its library code when it runs.
"""

from __future__ import annotations

from typing import Any

from rlhf_ops.pipeline.job_requests import (
    EvaluateRequest,
    FetchChampionRequest,
    PreflightRequest,
    PrepareDataRequest,
    RegisterRequest,
    RetainRequest,
)


def prepare_data(request: PrepareDataRequest) -> dict[str, Any]:
    from rlhf_ops.pipeline.data import prepare_for_run
    from rlhf_ops.pipeline.params import parse_params
    from rlhf_ops.pipeline.tracking import MAX_REJECTED_SAMPLE, read_json, read_jsonl_head

    prepared = prepare_for_run(
        parse_params(request.params), request.run.layout(), override_policy=request.override_policy
    )
    prepared["manifest"] = read_json(str(prepared["manifest_url"]))
    prepared["rejected_sample"] = read_jsonl_head(str(prepared["rejected_url"]), MAX_REJECTED_SAMPLE)
    return prepared


def fetch_champion(request: FetchChampionRequest) -> dict[str, Any]:
    from rlhf_ops.pipeline.register import fetch_champion

    return fetch_champion(request.registered_name, models_dir=request.run.layout().models_dir)


def preflight(request: PreflightRequest) -> dict[str, Any]:
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


def evaluate(request: EvaluateRequest) -> dict[str, Any]:
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


def retain(request: RetainRequest) -> dict[str, Any]:
    from rlhf_ops.pipeline.promotion import PromotionSpec
    from rlhf_ops.pipeline.retention import sync_and_retain

    return sync_and_retain(
        request.run.layout(),
        keep_last=request.keep_last,
        metric=request.metric,
        promotion=PromotionSpec.model_validate(request.promotion),
    )


def register(request: RegisterRequest) -> dict[str, Any]:
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
