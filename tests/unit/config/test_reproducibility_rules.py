"""Pre-flight of ``trainer.deterministic``, ``trainer.replay_rollouts`` and ``trainer.early_stop``: one line
naming the key and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.config.reproducibility_rules import DUMP_FORMAT, MANIFEST, step_file

VAL = ["trainer.test_freq=2"]
KV = "rollout.kv_cache_memory_bytes=67108864"


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_deterministic_is_accepted_on_the_sync_cpu_paths_and_off_by_default() -> None:
    assert load_config("tiny-cpu").trainer.deterministic is False
    assert load_config("tiny-cpu", ["trainer.deterministic=true"]).trainer.deterministic is True
    assert load_config("tiny-cpu", ["trainer.deterministic=true", "rollout.engine=vllm", KV]).rollout.engine == "vllm"


def test_deterministic_refuses_an_async_engine_a_pipeline_and_flash_attention() -> None:
    got = _problems(
        [
            "trainer.deterministic=true",
            "rollout.engine=vllm",
            "rollout.mode=async",
            KV,
            "trainer.pipeline=one_step_off",
            "model.attn_implementation=flash_attention_2",
        ]
    )
    assert "rollout.mode=sync" in got["rollout.mode"] and "arrive" in got["rollout.mode"]
    assert "trainer.pipeline=sync" in got["trainer.pipeline"]
    assert "sdpa" in got["model.attn_implementation"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.early_stop.metric=train/reward", "trainer.early_stop.threshold=1", *VAL], "never logged by"),
        (
            ["trainer.early_stop.metric=val/reward/mean", "trainer.early_stop.patience=2", "trainer.test_freq=0"],
            "trainer.test_freq=0",
        ),
        (["trainer.early_stop.metric=val/reward/mean", *VAL], "neither threshold nor patience"),
        (["trainer.early_stop.threshold=0.9", *VAL], "is null"),
    ],
)
def test_an_early_stop_metric_that_is_never_read_is_one_line(overrides: list[str], needle: str) -> None:
    got = _problems(overrides)
    assert list(got) == ["trainer.early_stop.metric"]
    assert needle in got["trainer.early_stop.metric"] and "Fix:" in got["trainer.early_stop.metric"]


def test_a_valid_early_stop_loads() -> None:
    cfg = load_config("tiny-cpu", ["trainer.early_stop.metric=val/reward/mean", "trainer.early_stop.patience=3", *VAL])
    assert cfg.trainer.early_stop.patience == 3 and cfg.trainer.early_stop.mode == "max"


def _dump(root: Path, *, steps: list[int], model: str = "builtin:tiny-llama", n: int = 16) -> Path:
    root.mkdir(parents=True)
    manifest = {
        "format": DUMP_FORMAT,
        "model": {"path": model, "fingerprint": "0" * 64},
        "data.train_batch_size": 16,
        "rollout.n": n,
        "seed": 1,
        "total_steps": 3,
    }
    (root / MANIFEST).write_text(json.dumps(manifest))
    for step in steps:
        (root / step_file(step)).write_bytes(b"x")
    return root


def test_a_complete_dump_of_this_model_is_accepted(tmp_path: Path) -> None:
    folder = _dump(tmp_path / "rollouts", steps=[1, 2, 3])
    cfg = load_config("tiny-cpu", [f"trainer.replay_rollouts={folder}", "trainer.total_training_steps=3"])
    assert cfg.trainer.replay_rollouts == str(folder)


def test_a_missing_folder_or_one_without_a_manifest_is_one_line(tmp_path: Path) -> None:
    got = _problems([f"trainer.replay_rollouts={tmp_path / 'nothere'}"])
    assert "is not a folder" in got["trainer.replay_rollouts"]
    got = _problems([f"trainer.replay_rollouts={tmp_path}"])
    assert "holds no manifest.json" in got["trainer.replay_rollouts"]


def test_a_partial_dump_names_the_missing_step_and_the_steps_to_set(tmp_path: Path) -> None:
    folder = _dump(tmp_path / "rollouts", steps=[1, 3])
    got = _problems([f"trainer.replay_rollouts={folder}", "trainer.total_training_steps=3"])
    assert "partial: no batch for step(s) [2]" in got["trainer.replay_rollouts"]
    assert "trainer.total_training_steps=1" in got["trainer.replay_rollouts"]


def test_a_dump_of_another_model_or_batch_shape_is_refused(tmp_path: Path) -> None:
    folder = _dump(tmp_path / "rollouts", steps=[1, 2, 3], model="builtin:smollm2-135m-instruct", n=8)
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [f"trainer.replay_rollouts={folder}", "trainer.total_training_steps=3"])
    text = "\n".join(str(p) for p in info.value.problems)
    assert "dumped from model builtin:smollm2-135m-instruct, this run trains builtin:tiny-llama" in text
    assert "rollout.n=8, here 16" in text
