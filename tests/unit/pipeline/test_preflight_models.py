"""Pre-flight refuses an architecture that cannot work, with the reason; the tested families pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.pipeline.preflight import preflight_problems
from rlhf_ops.pipeline.preflight_models import check_architecture, vllm_architectures
from tests.support.tiny_families import FAMILIES, build_tiny_family_dir

VLLM_KV = "rollout.kv_cache_memory_bytes=67108864"


def _config(model_dir: Path | str, *overrides: str) -> object:
    return load_config("tiny-cpu", [f"model.path={model_dir}", "data.val_files=[]", *overrides])


def _folder(tmp_path: Path, **config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family_dir(tmp_path_factory.mktemp("gemma2") / "m", "gemma2")


def test_gemma2_soft_capping_with_sdpa_is_refused_in_one_line(gemma2_dir: Path) -> None:
    problems = [str(p) for p in preflight_problems(_config(gemma2_dir, "model.attn_implementation=sdpa"))]
    assert problems == [
        "model.attn_implementation: sdpa has no attention soft-capping, which Gemma2ForCausalLM uses "
        "(attn_logit_softcapping=50.0): transformers drops it silently and the log-probs would be those of another "
        "model. Fix: set model.attn_implementation=eager (or flash_attention_2 on GPUs)"
    ]
    assert preflight_problems(_config(gemma2_dir, "model.attn_implementation=eager")) == []


@pytest.mark.skipif(vllm_architectures() is None, reason="vLLM is not installed")
def test_an_architecture_vllm_lacks_is_refused_with_the_vllm_engine_only(tmp_path: Path) -> None:
    # BioGPT: transformers builds it, the installed vLLM has no implementation (nor of a made-up name).
    folder = _folder(tmp_path, model_type="biogpt", architectures=["BioGptForCausalLM"])
    problems = check_architecture(_config(folder, "rollout.engine=vllm", VLLM_KV))
    assert [p.key for p in problems] == ["rollout.engine"]
    assert "has no implementation of BioGptForCausalLM" in problems[0].message
    assert problems[0].fix.startswith("set rollout.engine=hf")
    assert check_architecture(_config(folder, "rollout.engine=hf")) == []


@pytest.mark.skipif(vllm_architectures() is None, reason="vLLM is not installed")
def test_the_tested_families_pass_with_the_vllm_engine(tmp_path: Path) -> None:
    assert vllm_architectures() is not None and "LlamaForCausalLM" in vllm_architectures()  # type: ignore[operator]
    for family in FAMILIES:
        arch = json.loads(build_tiny_family_dir(tmp_path / family, family).joinpath("config.json").read_text())
        assert check_architecture(_config(tmp_path / family, "rollout.engine=vllm", VLLM_KV)) == [], arch[
            "architectures"
        ]
