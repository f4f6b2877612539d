"""The champion decision through a real MLflow server: win moves the alias, tie and loss keep it, all logged."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from rlhf_ops.evaluation.evaluator import log_eval_to_mlflow
from rlhf_ops.pipeline.champion import DECISION_ARTIFACT, decide, move_champion
from rlhf_ops.pipeline.promotion import PromotionSpec
from rlhf_ops.tracking.mlflow_tracking import MlflowLogger
from tests.support.mlflow_server import mlflow_server
from tests.unit.pipeline.test_promotion import report, right

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NAME = "promotion-it"
SPEC = PromotionSpec(method="wald", min_gain=0.05)


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


def _run(client: MlflowClient, reports: dict[int, dict[str, Any]], tracking_uri: str) -> str:
    """A pipeline run whose checkpoints were evaluated: each report logged as the evaluate task logs it."""
    exp = client.get_experiment_by_name("promotion-it")
    exp_id = exp.experiment_id if exp else client.create_experiment("promotion-it")
    run_id = str(client.create_run(exp_id).info.run_id)
    for step, rep in reports.items():
        log_eval_to_mlflow(rep, run_id=run_id, step=step, tracking_uri=tracking_uri)
    return run_id


def _register(run_id: str, tmp: Path, tracking_uri: str) -> Callable[[int], str]:
    def log_export(step: int) -> str:
        hf = tmp / f"hf_{run_id}_{step}"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text(json.dumps({"model_type": "llama", "step": step}))
        uri = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False).log_model_dir(hf)
        assert uri is not None
        return uri

    return log_export


def _decide(reports: dict[int, dict[str, Any]], tmp: Path, uri: str) -> tuple[str, dict[str, Any]]:
    client = MlflowClient(uri)
    run_id = _run(client, reports, uri)
    result = decide(
        reports,
        spec=SPEC,
        metric="eval/acc",
        mlflow_run_id=run_id,
        registered_name=NAME,
        register=_register(run_id, tmp, uri),
        tracking_uri=uri,
    )
    result["promoted"] = move_champion(result, run_id=run_id, tracking_uri=uri)
    return run_id, result


def test_win_tie_loss_through_mlflow(tracking_uri: str, tmp_path: Path) -> None:
    client = MlflowClient(tracking_uri)
    # Run A: step 2 wins over step 1 (30 prompts gained, [0.210, 0.390] above 0.05); no champion yet.
    run_a, a = _decide({1: report(right(0)), 2: report(right(30))}, tmp_path, tracking_uri)
    assert (a["best_step"], a["version"], a["decision"]["outcome"], a["promoted"]) == (2, "1", "no_incumbent", True)
    assert [d["outcome"] for d in a["checkpoint_decisions"]] == ["win"]
    assert client.get_model_version_by_alias(NAME, "champion").version == "1"
    run = client.get_run(run_a)
    assert run.data.params["promotion.min_gain"] == "0.05" and run.data.params["promotion.method"] == "wald"
    assert run.data.metrics["promotion/checkpoint/low"] == pytest.approx(0.2102, abs=1e-4)
    assert run.data.tags["rlhf.promotion.checkpoints"].startswith("global_step_2 vs global_step_1 on eval/acc: win")

    # Run B: 32 right (the first 30 plus 2): gain +0.02, Wald [-0.0074, +0.0474]: a tie, champion v1 stays.
    run_b, b = _decide({1: report(right(32))}, tmp_path, tracking_uri)
    assert (b["version"], b["champion_version"], b["decision"]["outcome"], b["promoted"]) == ("2", "1", "tie", False)
    assert client.get_model_version_by_alias(NAME, "champion").version == "1"
    v2 = client.get_model_version(NAME, "2")
    assert v2.tags["rlhf.promotion.outcome"] == "tie" and v2.tags["rlhf.promotion.vs_version"] == "1"
    assert float(v2.tags["rlhf.promotion.low"]) == pytest.approx(-0.0074, abs=1e-4)
    assert float(v2.tags["rlhf.promotion.high"]) == pytest.approx(0.0474, abs=1e-4)
    run = client.get_run(run_b)
    assert run.data.tags["rlhf.promoted"] == "false"
    assert run.data.metrics["promotion/champion/gain"] == pytest.approx(0.02)
    saved = json.loads(Path(client.download_artifacts(run_b, DECISION_ARTIFACT, str(tmp_path / "dl"))).read_text())
    assert saved["decision"]["gain"]["low"] == pytest.approx(-0.0074, abs=1e-4)

    # Run C: 10 right: 20 prompts lost against v1, [-0.278, -0.122]: a loss.
    _, c = _decide({1: report(right(10))}, tmp_path, tracking_uri)
    assert (c["version"], c["decision"]["outcome"], c["promoted"]) == ("3", "loss", False)

    # Run D: 60 right: 30 more than v1, [0.210, 0.390] above the margin: the champion moves to v4.
    _, d = _decide({1: report(right(60))}, tmp_path, tracking_uri)
    assert (d["version"], d["decision"]["outcome"], d["promoted"]) == ("4", "win", True)
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert champion.version == "4" and champion.tags["rlhf.previous_champion"] == "1"

    # A report on another eval set cannot be paired with the champion's (and nothing re-evaluates it here).
    with pytest.raises(ValueError, match="evaluated on different eval sets"):
        _decide({1: report(right(90), eval_set="other")}, tmp_path, tracking_uri)
