"""The champion decision in MLflow: register the run's best checkpoint, test it against the champion, log why.

``decide`` registers the candidate as a new version (every candidate stays in the audit trail), finds the
champion's eval report (the eval report artifact of the champion's run, named by the version's
``rlhf.eval_report`` tag), and runs the paired test of :mod:`rlhf_ops.pipeline.promotion` on the prompts both
were evaluated on. When the champion was evaluated on another eval set (new data this week), it is evaluated
again on this run's set through ``evaluate_champion`` so the comparison stays paired.

The decision and its interval are logged where a reviewer looks for them: run params (the spec: metric,
margin, confidence, method), run tags and metrics (``promotion/champion/{gain,low,high,n}``, the checkpoint
walk at each challenger's step under ``promotion/checkpoint/...``), tags of the registered version, and the
whole decision as ``promotion/decision.json``. ``move_champion`` moves the alias (at once, or after the
approval gate).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.promotion import Decision, PromotionSpec, choose_checkpoint, compare, eval_set_id

log = logging.getLogger(__name__)

TAG_EVAL_REPORT = "rlhf.eval_report"
TAG_EVAL_SET = "rlhf.eval_set_sha256"
DECISION_ARTIFACT = "promotion/decision.json"


def champion_report(client: Any, version: Any) -> dict[str, Any] | None:
    """The eval report the champion was registered with (None for versions registered without one)."""
    path = version.tags.get(TAG_EVAL_REPORT)
    if not path or not version.run_id:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(version.run_id, path, tmp)
        except Exception as exc:  # deleted run or artifact: re-evaluate instead
            log.warning("champion v%s: cannot read %s (%s)", version.version, path, exc)
            return None
        data = json.loads(Path(local).read_text())
    return data if isinstance(data, dict) else None


def _champion_vs(
    client: Any,
    champion: Any,
    candidate: Mapping[str, Any],
    spec: PromotionSpec,
    *,
    metric: str,
    label: str,
    evaluate_champion: Callable[[], dict[str, Any]] | None,
) -> Decision:
    if champion is None:
        return compare(None, candidate, spec, metric=metric, names=(None, label))
    report = champion_report(client, champion)
    same_set = report is not None and eval_set_id(report) == eval_set_id(candidate) is not None
    if not same_set and evaluate_champion is not None:
        log.info("champion v%s was evaluated on another eval set: evaluating it on this run's", champion.version)
        report = evaluate_champion()
    if report is None:
        raise ValueError(
            f"champion v{champion.version} has no eval report to compare with; re-register it or remove its alias"
        )
    return compare(report, candidate, spec, metric=metric, names=(f"champion v{champion.version}", label))


def decide(
    reports: Mapping[int, Mapping[str, Any]],
    *,
    spec: PromotionSpec,
    metric: str,
    mlflow_run_id: str,
    registered_name: str,
    register: Callable[[int], str],
    evaluate_champion: Callable[[], dict[str, Any]] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Choose the run's checkpoint, register it, and test it against the champion (the alias does not move here).

    Args:
        reports: ``{step: eval report}`` of the run's evaluated checkpoints.
        spec: The promotion spec.
        metric: The per-prompt metric (``spec.metric_name(eval_metric)``).
        mlflow_run_id: The pipeline's MLflow run.
        registered_name: The registered model.
        register: Logs checkpoint ``step``'s HF export to the run and returns its model URI.
        evaluate_champion: Evaluates the champion on this run's eval set (used when its own report is on another).
        tracking_uri: MLflow server.

    Returns:
        ``{"best_step", "metric", "value", "model_uri", "registered_name", "version", "champion_version",
        "decision", "checkpoint_decisions", "promote"}`` (``promote``: the alias should move).
    """
    from mlflow import MlflowClient

    from rlhf_ops.tracking.artifacts import eval_report_artifact
    from rlhf_ops.tracking.registry import register_candidate

    step, walk = choose_checkpoint(reports, spec, metric=metric)
    if step is None:
        raise ValueError("no evaluated checkpoint to register; check the evaluate tasks")
    candidate = reports[step]
    value = float(candidate["metrics"][metric])
    model_uri = register(step)
    version, champion = register_candidate(
        run_id=mlflow_run_id,
        model_uri=model_uri,
        registered_name=registered_name,
        metric_name=metric,
        metric_value=value,
        tracking_uri=tracking_uri,
    )
    client = MlflowClient(tracking_uri=tracking_uri)
    if champion is not None and champion.version == version.version:
        champion = None  # a retry after the alias moved: this version is already the champion
        prior = client.get_model_version(registered_name, version.version).tags.get("rlhf.promotion.champion")
        if prior:
            return json.loads(prior)
    label = f"v{version.version} (global_step_{step})"
    decision = _champion_vs(
        client, champion, candidate, spec, metric=metric, label=label, evaluate_champion=evaluate_champion
    )
    for line in [*(d.summary() for d in walk), decision.summary()]:
        log.info("promotion: %s", line)
    result = {
        "best_step": step,
        "metric": metric,
        "value": value,
        "model_uri": model_uri,
        "registered_name": registered_name,
        "version": str(version.version),
        "champion_version": None if champion is None else str(champion.version),
        "decision": decision.to_dict(),
        "summary": decision.summary(),
        "checkpoint_decisions": [d.to_dict() for d in walk],
        "promote": decision.replaces,
    }
    version_tags = {
        TAG_EVAL_REPORT: eval_report_artifact(step),
        TAG_EVAL_SET: eval_set_id(candidate) or "",
        "rlhf.best_step": str(step),
        "rlhf.promotion.outcome": decision.outcome,
        "rlhf.promotion.summary": decision.summary()[:4000],
        "rlhf.promotion.vs_version": result["champion_version"] or "",
        **{f"rlhf.promotion.{k.rsplit('/', 1)[1]}": repr(v) for k, v in decision.metrics("x").items()},
    }
    for key, tag in version_tags.items():
        client.set_model_version_tag(registered_name, version.version, key, tag)
    _log_run(mlflow_run_id, result, spec, walk, decision, tracking_uri=tracking_uri)
    return result


def _log_run(
    run_id: str,
    result: Mapping[str, Any],
    spec: PromotionSpec,
    walk: list[Decision],
    decision: Decision,
    *,
    tracking_uri: str | None,
) -> None:
    from rlhf_ops.tracking.mlflow_tracking import MlflowLogger

    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False)
    try:
        logger.log_params(
            {
                "promotion.metric": result["metric"],
                "promotion.min_gain": spec.min_gain,
                "promotion.confidence": spec.confidence,
                "promotion.method": spec.method,
            }
        )
        step = int(result["best_step"])
        logger.log_metrics(decision.metrics("promotion/champion"), step=step)
        for d in walk:
            challenger = int(d.candidate.removeprefix("global_step_"))
            logger.log_metrics(d.metrics("promotion/checkpoint"), step=challenger)
        logger.set_tags(
            {
                "rlhf.best_step": step,
                "rlhf.model_version": result["version"],
                "rlhf.promotion.outcome": decision.outcome,
                "rlhf.promotion.summary": decision.summary(),
                "rlhf.promotion.checkpoints": " | ".join(d.summary() for d in walk) or "one checkpoint",
            }
        )
        logger.log_dict(dict(result), DECISION_ARTIFACT)
    finally:
        logger.close()


def move_champion(result: Mapping[str, Any], *, run_id: str, tracking_uri: str | None = None) -> bool:
    """Move the ``champion`` alias to the decided version when the decision says so; returns whether it moved."""
    from mlflow import MlflowClient

    from rlhf_ops.tracking.mlflow_tracking import set_run_tags
    from rlhf_ops.tracking.registry import move_alias

    moved = bool(result.get("promote"))
    name, version = str(result["registered_name"]), str(result["version"])
    if moved:
        move_alias(
            registered_name=name, version=version, previous=result.get("champion_version"), tracking_uri=tracking_uri
        )
    compact = {k: v for k, v in result.items() if k not in ("checkpoint_decisions", "decision")}
    summary = json.dumps({**compact, "promoted": moved}, default=str)  # read back by a retried decide()
    MlflowClient(tracking_uri=tracking_uri).set_model_version_tag(name, version, "rlhf.promotion.champion", summary)
    set_run_tags(tracking_uri=tracking_uri, run_id=run_id, tags={"rlhf.promoted": str(moved).lower()})
    log.info("%s v%s: champion %s (%s)", name, version, "moved" if moved else "kept", result.get("summary"))
    return moved
