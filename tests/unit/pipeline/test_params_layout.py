"""Pipeline parameters → config overrides, the run layout, and the checkpoint plan (no Airflow, no torch)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.pipeline.layout import RunLayout, patched_environ, run_key
from rlhf_ops.pipeline.params import PipelineParams, param_overrides, parse_params, run_overrides, train_entrypoint
from rlhf_ops.pipeline.preflight import plan_checkpoints, resolve_run_config

RUN_ID = "manual__2026-11-29T10:00:00+00:00"


def test_run_key_is_folder_safe_stable_and_distinct() -> None:
    key = run_key(RUN_ID)
    assert key.startswith("manual__2026-11-29T10-00-00-00-00-")  # ':' and '+' replaced
    assert key == run_key(RUN_ID)  # a retry finds the same folder
    assert run_key("a:b") != run_key("a+b")  # same sanitised body, different digest
    with pytest.raises(ValueError, match="run_id is empty"):
        run_key("")


def test_layout_keys_every_folder_by_dag_and_run(tmp_path: Path) -> None:
    layout = RunLayout.for_run(dag_id="rlhf_ppo", run_id=RUN_ID, work_dir=str(tmp_path), remote_store_url="s3://b/ck/")
    key = run_key(RUN_ID)
    assert layout.local_run_dir == str(tmp_path / "checkpoints" / "rlhf_ppo" / key)
    assert layout.remote_run_url == f"s3://b/ck/rlhf_ppo/{key}"
    assert layout.data_root == str(tmp_path / "data" / "rlhf_ppo")
    assert RunLayout.from_dict(layout.to_dict()) == layout
    assert layout.checkpoint_url == layout.remote_run_url


def test_layout_needs_a_work_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLHF_WORK_DIR", raising=False)
    with pytest.raises(ValueError, match="work_dir is not set"):
        RunLayout.for_run(dag_id="d", run_id="r", work_dir=None)


def test_param_overrides_only_for_values_that_are_set() -> None:
    params = PipelineParams(algorithm="rloo", learning_rate=1e-4, kl_coef=0.02, rollout_n=4, use_kl_loss=False)
    assert param_overrides(params) == [
        'algorithm.adv_estimator="rloo"',
        "actor.optim.lr=0.0001",
        "algorithm.use_kl_loss=false",
        "algorithm.kl_loss_coef=0.02",
        "algorithm.kl_ctrl.kl_coef=0.02",
        "rollout.n=4",
    ]
    assert param_overrides(PipelineParams(max_train_minutes=90.5)) == ["trainer.early_stop.max_time_s=5430.0"]
    assert param_overrides(PipelineParams()) == []


def test_resolved_config_precedence_preset_form_overrides_pipeline(tmp_path: Path) -> None:
    params = PipelineParams(
        rollout_n=4, overrides=["rollout.n=6", "trainer.run_name=mine", "trainer.save_freq=3"], work_dir=str(tmp_path)
    )
    layout = RunLayout.for_run(dag_id="rlhf_ppo", run_id=RUN_ID, work_dir=str(tmp_path))
    prepared = {"train_url": "/d/train.parquet", "val_url": "/d/val.parquet", "num_train": 64, "num_val": 0}
    config, overrides = resolve_run_config(params, layout, prepared)
    assert config.rollout.n == 6  # free-form overrides beat the form's typed values
    assert config.trainer.run_name == layout.run_key  # the pipeline owns the run folder
    assert config.trainer.checkpoint_root == layout.checkpoint_root
    assert config.trainer.keep_last == 0 and config.trainer.resume_mode == "auto"
    assert "mlflow" in config.trainer.logger
    assert config.data.train_files == ["/d/train.parquet"]
    assert config.data.val_files == []  # an empty val.parquet is no validation set
    assert load_config("tiny-cpu", overrides) == config


def test_a_bad_value_fails_with_the_config_message(tmp_path: Path) -> None:
    params = PipelineParams(overrides=["rollout.n=1"], algorithm="grpo")
    layout = RunLayout.for_run(dag_id="d", run_id="r", work_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        resolve_run_config(params, layout, {"train_url": "/t.parquet", "num_train": 64})


def test_plan_checkpoints_follows_the_trainer_rule() -> None:
    config = load_config(
        "tiny-cpu",
        [
            "trainer.total_epochs=1",
            "trainer.total_training_steps=5",
            "trainer.save_freq=2",
            "data.train_batch_size=16",
        ],
    )
    # 1024 rows // 16 per batch = 64 steps per epoch, capped at 5; saves at 2, 4 and the last step 5
    assert plan_checkpoints(config, num_train=1024) == (5, [2, 4, 5])
    # 40 rows // 16 = 2 steps per epoch, 1 epoch: total 2, saves at 2 (save_freq) which is also the last
    assert plan_checkpoints(config, num_train=40) == (2, [2])
    with pytest.raises(ValueError, match="train_batch_size=16 is larger than the 15"):
        plan_checkpoints(config, num_train=15)


def test_train_entrypoint_quotes_every_override() -> None:
    cmd = train_entrypoint("tiny-cpu", ['data.train_files=["/a b/train.parquet"]', "x.y=$(rm -rf /)"])
    words = shlex.split(cmd)
    assert words[:5] == ["python", "-m", "workers.entrypoints.train", "--preset", "tiny-cpu"]
    assert words[5:] == ['data.train_files=["/a b/train.parquet"]', "x.y=$(rm -rf /)"]  # one word each, no shell


def test_run_overrides_put_the_warm_start_model_last(tmp_path: Path) -> None:
    layout = RunLayout.for_run(dag_id="d", run_id="r", work_dir=str(tmp_path))
    items = run_overrides(layout, train_url="t", val_url="v", model_path="/models/champ")
    assert items[-1] == 'model.path="/models/champ"'


def test_parse_params_refuses_unknown_keys() -> None:
    with pytest.raises(ValueError, match="not_a_param"):
        parse_params({"not_a_param": 1})


def test_patched_environ_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_T_A", "old")
    monkeypatch.delenv("RLHF_T_B", raising=False)
    import os

    with patched_environ({"RLHF_T_A": "new", "RLHF_T_B": "b"}):
        assert (os.environ["RLHF_T_A"], os.environ["RLHF_T_B"]) == ("new", "b")
    assert os.environ["RLHF_T_A"] == "old" and "RLHF_T_B" not in os.environ
