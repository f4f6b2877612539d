"""``model.modality`` and every error path of a vision-language policy's configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.models.modality import detect_modality


def _problems(overrides: list[str], preset: str = "tiny-vlm-cpu") -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


def _model_dir(tmp_path: Path, config: dict[str, object]) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_modality_is_detected_from_config_json(tmp_path: Path) -> None:
    vlm = _model_dir(tmp_path / "vlm", {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}})
    text = _model_dir(tmp_path / "text", {"architectures": ["LlamaForCausalLM"]})
    assert detect_modality(vlm) == "vision_language" and detect_modality(text) == "text"
    assert detect_modality("builtin:tiny-vlm") == "vision_language"
    assert detect_modality(str(tmp_path / "missing")) is None


def test_explicit_modality_that_contradicts_the_model_is_refused(tmp_path: Path) -> None:
    problems = _problems(["model.modality=vision_language"], preset="tiny-cpu")
    assert problems == {
        "model.modality": "vision_language but model.path='builtin:tiny-llama' is a text model (by its "
        "config.json). Fix: set model.modality=auto"
    }
    assert load_config("tiny-vlm-cpu", ["model.modality=vision_language"]).model.modality == "vision_language"


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=false"], "algorithm.adv_estimator", "use grpo, rloo"),
        (["reward.model_path=/models/rm"], "reward.model_path", "score with reward.reward_fn instead"),
        (["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=67108864"], "rollout.engine", "set rollout.engine=hf"),
        (
            ["actor.ulysses_sequence_parallel_size=2", "actor.use_remove_padding=true"],
            "actor.ulysses_sequence_parallel_size",
            "set 1",
        ),
        (["model.lora.rank=8"], "model.lora.rank", "set 0 (full fine-tuning)"),
        (["actor.share_prompt_prefix=true"], "actor.share_prompt_prefix", "set false"),
    ],
)
def test_what_a_vision_language_policy_cannot_use_is_refused(overrides: list[str], key: str, fix: str) -> None:
    problems = _problems(overrides)
    assert key in problems and "with a vision-language policy" in problems[key]
    assert f"Fix: {fix}" in problems[key]
    assert key not in _problem_keys(overrides, preset="tiny-cpu")  # the text policy may use it


def _problem_keys(overrides: list[str], *, preset: str) -> set[str]:
    try:
        load_config(preset, overrides)
    except ConfigError as exc:
        return {p.key for p in exc.problems}
    return set()


def test_a_local_vlm_directory_is_detected_without_setting_modality(tmp_path: Path) -> None:
    vlm = _model_dir(tmp_path / "vlm", {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}})
    problems = _problems([f"model.path={vlm}", "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1048576"])
    assert set(problems) == {"rollout.engine"}
