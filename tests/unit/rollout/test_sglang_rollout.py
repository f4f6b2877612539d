"""``rollout.engine=sglang``: its config and import paths, the pre-flight's refusal where SGLang is not
installed (this machine), and the adapter's arithmetic against a stand-in for SGLang's ``Engine`` (SGLang
itself has not run here: its PyPI wheels carry CUDA kernels only)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch

from rlhf_ops.config import load_config
from rlhf_ops.config.extension_rules import engine_package_problems
from rlhf_ops.extensions import ROLLOUT_ENGINES
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams

NO_SGLANG = importlib.util.find_spec("sglang") is None


class StandInEngine:
    """Answers like ``sglang.Engine`` (token ids in, ``output_ids`` + ``output_token_logprobs`` out)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.weights: list[str] = []
        self.calls: list[str] = []

    def generate(self, *, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], return_logprob: bool):
        self.requests.append({"input_ids": input_ids, "sampling_params": sampling_params})
        # Row i answers i + 1 tokens (7, 8, ...), the last one EOS (2) when it fits; log-prob -0.5 per token.
        outs = []
        for i, _ in enumerate(input_ids):
            ids = [7 + k for k in range(i)] + [2]
            outs.append({"output_ids": ids, "meta_info": {"output_token_logprobs": [(-0.5, t, None) for t in ids]}})
        return outs

    def update_weights_from_tensor(self, *, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        self.weights += [name for name, _ in named_tensors]

    def flush_cache(self) -> None:
        self.calls.append("flush")

    def release_memory_occupation(self) -> None:
        self.calls.append("release")

    def resume_memory_occupation(self) -> None:
        self.calls.append("resume")


def _engine(stand_in: StandInEngine) -> Any:
    from workers.rollout.sglang_rollout import SGLangRollout

    config = load_config("tiny-cpu", ["rollout.engine=sglang", "rollout.max_new_tokens=3"]).rollout
    return SGLangRollout(
        "unused", config=config, pad_token_id=0, eos_token_id=2, seed=5, device="cpu", engine=stand_in
    )


def test_the_module_imports_without_sglang_and_the_table_resolves_it() -> None:
    code = "import sys, workers.rollout.sglang_rollout as m; print(callable(m.build_engine), 'sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]
    entry = ROLLOUT_ENGINES.get("sglang")
    assert entry.load().__module__ == "workers.rollout.sglang_rollout" and entry.weight_sync
    assert entry.modes == ("sync", "async") and entry.load_async().__name__ == "build_async_engine"


@pytest.mark.skipif(not NO_SGLANG, reason="SGLang is installed here")
def test_preflight_refuses_sglang_with_the_reason() -> None:
    run = load_config("tiny-cpu", ["rollout.engine=sglang"])  # a valid config: the value is in the table
    problems = engine_package_problems(run)
    assert [p.key for p in problems] == ["rollout.engine"]
    assert "needs the Python package 'sglang', which is not installed here" in problems[0].message
    assert "has not run on this project's machines" in problems[0].message
    assert engine_package_problems(load_config("tiny-cpu")) == []  # hf needs no package


@pytest.mark.skipif(not NO_SGLANG, reason="SGLang is installed here")
def test_building_without_sglang_is_one_clear_error() -> None:
    from workers.rollout.sglang_rollout import SGLangRollout

    config = load_config("tiny-cpu", ["rollout.engine=sglang"]).rollout
    with pytest.raises(RuntimeError, match="rollout.engine=sglang needs the 'sglang' package"):
        SGLangRollout("m", config=config, pad_token_id=0, eos_token_id=2, seed=0, device="cpu")


def test_generate_pads_masks_and_seeds_by_step() -> None:
    stand_in = StandInEngine()
    engine = _engine(stand_in)
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0, 11, 12], [13, 14, 15]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
        }
    )
    sampling = SamplingParams(n=2, response_length=3, eos_token_id=2, pad_token_id=0)
    out = engine.generate_sequences(prompts, sampling, step=4)
    request = stand_in.requests[0]
    assert request["input_ids"] == [[11, 12], [11, 12], [13, 14, 15], [13, 14, 15]]  # left padding stripped, n=2
    # Row answers: [2], [7, 2], [7, 8, 2], [7, 8, 9, 2] cut to R=3 -> the mask ends at the first EOS.
    assert out.tensors["responses"].tolist() == [[2, 0, 0], [7, 2, 0], [7, 8, 2], [7, 8, 9]]
    assert out.tensors["response_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert out.tensors["rollout_log_probs"][1].tolist() == [-0.5, -0.5, 0.0]
    assert out.tensors["input_ids"].shape == (4, 6)
    engine.generate_sequences(prompts, sampling, step=4)
    seeds = [[p["sampling_seed"] for p in r["sampling_params"]] for r in stand_in.requests]
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 4  # the same step draws the same seeds
    assert request["sampling_params"][0]["stop_token_ids"] == [2]


def test_weight_sync_and_memory_release() -> None:
    stand_in = StandInEngine()
    engine = _engine(stand_in)
    engine.update_weights(iter([("a.weight", torch.ones(2)), ("b.weight", torch.zeros(2))]))
    engine.release()
    engine.release()  # idempotent
    engine.resume()
    assert stand_in.weights == ["a.weight", "b.weight"]
    assert stand_in.calls == ["flush", "release", "resume"] and not engine.weights_released
