"""Who may do what: the trigger form's overrides are limited to a spec-declared set; reward code loads only from
the operator's allow-list of modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from rlhf_ops.code_policy import ALLOWED_MODULES_ENV, PLATFORM_CONFIG_ENV, CodeNotAllowedError, check_code_allowed
from rlhf_ops.config import load_config
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.override_policy import OverridePolicy
from rlhf_ops.pipeline.params import PipelineParams
from rlhf_ops.pipeline.preflight import PreflightError, preflight_problems, run_preflight
from rlhf_ops.rewards import load_reward_fn
from tests.reliability.conftest import Figures

HOSTILE_OVERRIDES = [
    "model.trust_remote_code=true",
    "reward.reward_fn=os:system",
    "resources.ray_address=ray://attacker:10001",
    "tracking.mlflow_uri=http://attacker:5000",
    "model.path=/home/other-team/model",
    "trainer.checkpoint_root=/etc",
    "critic.model_path=/somewhere",
]


def _prepared(tmp_path: Path) -> dict[str, object]:
    train = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": "copy: 3", "ground_truth": "3", "data_source": "copy_digit"}]).to_parquet(train)
    return {"train_url": str(train), "num_train": 160, "num_val": 0}


def test_form_overrides_outside_the_allowed_set_are_refused_at_preflight(tmp_path: Path, figures: Figures) -> None:
    layout = RunLayout.for_run(dag_id="d", run_id="r", work_dir=str(tmp_path))
    params = PipelineParams(overrides=["rollout.temperature=0.7", *HOSTILE_OVERRIDES])
    with pytest.raises(PreflightError) as caught:
        run_preflight(params, layout, _prepared(tmp_path))
    lines = [str(p) for p in caught.value.problems]
    assert len(lines) == len(HOSTILE_OVERRIDES)  # rollout.temperature is a training knob: allowed
    for line, override in zip(lines, HOSTILE_OVERRIDES, strict=True):
        key = override.partition("=")[0]
        assert line.startswith(f"overrides: '{key}' may not be set from this pipeline's trigger form"), line
        assert "allowed_overrides" in line and "\n" not in line
    figures.record(hostile_overrides=len(HOSTILE_OVERRIDES), refused=len(lines))
    # Knobs of the default set pass, and the spec can allow more (here by pattern) or trust its own overrides.
    ok = PipelineParams(overrides=["rollout.temperature=0.7", "actor.optim.lr=1e-5", "model.lora.rank=4"])
    policy = {"extra_allowed": ["model.lora.*"], "trusted": [], "spec": "dags/specs/x.yaml"}
    assert run_preflight(ok, layout, _prepared(tmp_path), override_policy=policy)["total_steps"] == 20
    trusted = {"trusted": ["trainer.checkpoint_root=/shared/ckpt"]}
    assert OverridePolicy.from_dict(trusted).problems(["trainer.checkpoint_root=/shared/ckpt"]) == []
    assert OverridePolicy.from_dict(trusted).problems(["trainer.checkpoint_root=/elsewhere"]) != []


def test_prepare_data_refuses_a_form_override_before_reading_anything(tmp_path: Path) -> None:
    from rlhf_ops.config import ConfigError
    from rlhf_ops.pipeline.data import prepare_for_run

    secret = tmp_path / "other-team" / "rows.jsonl"  # what a form user should not be able to read into a run
    secret.parent.mkdir()
    secret.write_text('{"prompt": "private", "ground_truth": "1"}\n')
    layout = RunLayout.for_run(dag_id="d", run_id="r", work_dir=str(tmp_path / "work"))
    params = PipelineParams(overrides=[f"data.train_files=[{secret}]"])
    with pytest.raises(ConfigError, match="'data.train_files' may not be set from this pipeline's trigger form"):
        prepare_for_run(params, layout)
    assert not list((tmp_path / "work").rglob("*.parquet"))


def test_the_default_set_holds_no_key_that_runs_code_or_moves_data() -> None:
    policy = OverridePolicy()
    for override in HOSTILE_OVERRIDES + ["data.train_files=[/x]", "trainer.remote_store_url=s3://x/y"]:
        assert not policy.allows(override.partition("=")[0]), override
    assert policy.allows("algorithm.kl_ctrl.kl_coef") and policy.allows("trainer.total_training_steps")


def test_a_spec_declares_its_allowed_overrides_and_the_dag_passes_them_to_preflight(tmp_path: Path) -> None:
    from tests.support.airflow_env import configure_airflow_env

    configure_airflow_env()  # a throw-away Airflow home, before airflow is imported
    dags_dir = str(Path(__file__).resolve().parents[2] / "dags")
    if dags_dir not in sys.path:
        sys.path.append(dags_dir)  # as Airflow does when it parses the DAGs folder
    from rlhf_airflow.pipeline.specs import load_spec_dags

    (tmp_path / "lora.yaml").write_text(
        "schedule: null\npreset: tiny-cpu\noverrides: [trainer.total_training_steps=2]\n"
        "allowed_overrides: ['model.lora.*']\n"
    )
    (tmp_path / "bad.yaml").write_text("schedule: null\nallowed_overrides: model.lora.rank\n")
    with pytest.warns(UserWarning, match="allowed_overrides must be a list"):
        dags = load_spec_dags(tmp_path)
    policy = dags["rlhf_lora"].get_task("preflight").request["override_policy"]
    assert dags["rlhf_lora"].get_task("prepare_data").request["override_policy"] == policy
    assert policy["extra_allowed"] == ["model.lora.*"] and policy["trusted"] == ["trainer.total_training_steps=2"]
    assert "override_policy" not in dags["rlhf_lora"].params  # not a form field: the form cannot widen it
    assert OverridePolicy.from_dict(policy).problems(["model.lora.rank=8", "model.path=/x"])[0].message == (
        "'model.path' may not be set from this pipeline's trigger form"
    )


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """A reward module that leaves a marker file when imported (proof that refused code never ran)."""
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):"
        "\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


def test_reward_code_loads_only_from_the_operators_allow_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Figures
) -> None:
    marker = _module(tmp_path, monkeypatch, "team_rewards_x")
    monkeypatch.setenv(PLATFORM_CONFIG_ENV, str(tmp_path / "no-platform.yaml"))
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")  # a deployment's default: built-ins only
    with pytest.raises(CodeNotAllowedError, match="module 'team_rewards_x' is not on the platform's allow-list"):
        load_reward_fn("team_rewards_x:score")
    assert not marker.exists()  # refused before import: the module's code never ran
    assert load_reward_fn("rlhf_ops.rewards.toy:copy_digit_score")("toy", "3", "3", None)["score"] == 1.0
    assert load_reward_fn("copy_digit") is not None  # built-in names need no module
    # Pre-flight reports it on the config key, one line.
    config = load_config("tiny-cpu", ["reward.reward_fn=team_rewards_x:score", "trainer.logger=[console]"])
    lines = [str(p) for p in preflight_problems(config) if p.key == "reward.reward_fn"]
    assert len(lines) == 1 and "RLHF_ALLOWED_CODE_MODULES" in lines[0] and "\n" not in lines[0]
    # A prefix is a package boundary, not a string prefix.
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "team_rewards")
    with pytest.raises(CodeNotAllowedError):
        check_code_allowed("team_rewards_x", what="reward function")
    # The operator allows it, by environment or by the platform file.
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "other_pkg, team_rewards_x")
    assert load_reward_fn("team_rewards_x:score")("s", "a", "b", None) == 1.0 and marker.exists()
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    (tmp_path / "platform.yaml").write_text("allowed_code_modules: [team_rewards_x]\n")
    monkeypatch.setenv(PLATFORM_CONFIG_ENV, str(tmp_path / "platform.yaml"))
    check_code_allowed("team_rewards_x.sub", what="tool 'team_rewards_x.sub:Calc'")  # tools use the same list
    (tmp_path / "platform.yaml").write_text("allowed_code_modules: team_rewards_x\n")
    with pytest.raises(CodeNotAllowedError, match="must be a list of module prefixes"):
        check_code_allowed("team_rewards_x", what="reward function")
    figures.record(refused_modules=2, accepted_modules=3)
