"""The signature check, the overlong penalty and its config, and extra_info reaching the reward function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.models.resolve import resolve_model_path
from rlhf_ops.protocol import DataProto
from rlhf_ops.rewards import build_reward_fn, check_reward_fn
from rlhf_ops.rewards.gsm8k import gsm8k_score
from rlhf_ops.rewards.length import OverlongPenalty, overlong_penalty
from rlhf_ops.trainer.reward import RewardStage

# ---------------------------------------------------------------- check_reward_fn

_USER_MODULE = """
def good(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0

def good_args(*args, **kwargs):
    return 1.0

def three(data_source, solution_str, ground_truth):
    return 1.0

def renamed(source, text, truth, info=None):
    return 1.0

def extra_required(data_source, solution_str, ground_truth, extra_info, scale):
    return 1.0

def keyword_only(*, data_source, solution_str, ground_truth, extra_info):
    return 1.0

def good_kwargs(**kwargs):
    return 1.0

class Scorer:
    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

scorer = Scorer()
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_rewards_sig.py").write_text(_USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_sig"


def test_check_accepts_builtins_and_verl_signatures(user_module: str) -> None:
    assert check_reward_fn("gsm8k") is gsm8k_score
    for name in ("good", "good_args", "scorer"):
        fn = check_reward_fn(f"{user_module}:{name}")
        assert fn("d", "s", "g", None) == 1.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("three", r"three\(data_source, solution_str, ground_truth\) cannot be called positionally .*too many"),
        ("renamed", r"cannot be called by keyword .*missing a required argument: 'source'"),  # verl's keywords
        ("extra_required", r"cannot be called positionally .*'scale'"),
        ("keyword_only", r"cannot be called positionally"),
        ("good_kwargs", r"cannot be called positionally"),  # our reward stage passes positional arguments
    ],
)
def test_check_refuses_wrong_signatures_in_one_line(user_module: str, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_reward_fn(f"{user_module}:{name}")
    text = str(info.value)
    assert text.startswith(f"reward.reward_fn='{user_module}:{name}': ") and "\n" not in text
    assert "def fn(data_source, solution_str, ground_truth, extra_info=None)" in text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", r"^reward.reward_fn: reward function 'nope' is neither a built-in"),
        ("nope:fn", r"^reward.reward_fn: reward function 'nope:fn': cannot import module 'nope'"),
        ("rlhf_ops.rewards.gsm8k:missing", r"^reward.reward_fn: .*has no attribute 'missing'"),
        ("rlhf_ops.rewards.gsm8k:CLIP_CHARS", r"^reward.reward_fn: .*resolves to a int, which is not callable"),
    ],
)
def test_check_reports_load_errors_with_the_config_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_reward_fn(spec)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- overlong penalty


@pytest.mark.parametrize(
    ("length", "penalty"),
    [
        (0, 0.0),
        (12, 0.0),  # L_max - B = 16 - 4 = 12: the last length without penalty
        (13, -0.25),  # one token into the buffer: -1/4
        (14, -0.5),
        (16, -1.0),  # at L_max: -penalty_factor
    ],
)
def test_overlong_penalty_boundaries(length: int, penalty: float) -> None:
    assert overlong_penalty(length, max_response_length=16, buffer_len=4, penalty_factor=1.0) == penalty
    assert overlong_penalty(length, max_response_length=16, buffer_len=4, penalty_factor=0.5) == penalty / 2


def test_overlong_wrapper_penalises_score_not_acc() -> None:
    fn = OverlongPenalty(gsm8k_score, max_response_length=16, buffer_len=4, penalty_factor=1.0)
    right = fn("openai/gsm8k", "#### 12", "12", {"response_length": 14})
    assert right == {
        "score": 0.5, "acc": 1.0, "acc_strict": 1.0, "acc_flexible": 1.0, "overlong_reward": -0.5, "overlong": 1.0
    }  # fmt: skip
    short = fn("openai/gsm8k", "#### 12", "12", {"response_length": 3})
    assert (short["score"], short["overlong_reward"], short["overlong"]) == (1.0, 0.0, 0.0)

    def float_fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        return 0.25

    wrapped = OverlongPenalty(float_fn, max_response_length=8, buffer_len=8, penalty_factor=2.0)
    # L_max - B = 0: every token is in the buffer; L = 2 -> -2/8 * 2 = -0.5
    assert wrapped("d", "s", "g", {"response_length": 2}) == {"score": -0.25, "overlong_reward": -0.5, "overlong": 1.0}
    with pytest.raises(ValueError, match=r"extra_info\['response_length'\] is None"):
        wrapped("d", "s", "g", None)


def test_overlong_wrapper_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"reward.overlong_buffer.len=0 must be in 1..16"):
        OverlongPenalty(gsm8k_score, max_response_length=16, buffer_len=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match=r"reward.overlong_buffer.len=17 must be in 1..16"):
        build_reward_fn("gsm8k", max_response_length=16, overlong_buffer_len=17)
    with pytest.raises(ValueError, match=r"penalty_factor=-1.0 must be >= 0"):
        OverlongPenalty(gsm8k_score, max_response_length=16, buffer_len=4, penalty_factor=-1.0)
    assert build_reward_fn("gsm8k", max_response_length=16) is gsm8k_score  # disabled: unwrapped


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


def test_overlong_config_rules() -> None:
    # tiny-cpu: rollout.max_new_tokens=2
    ok = load_config("tiny-cpu", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"])
    assert ok.reward.overlong_buffer.len == 2 and ok.reward.overlong_buffer.penalty_factor == 1.0
    assert (
        "is not in 1..rollout.max_new_tokens=2"
        in _problems(["reward.overlong_buffer.enable=true"])["reward.overlong_buffer.len"]
    )
    too_long = _problems(["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=3"])
    assert "3 is not in 1..rollout.max_new_tokens=2" in too_long["reward.overlong_buffer.len"]
    no_fn = _problems(["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=1", "reward.reward_fn=null"])
    assert "reward.reward_fn is not set" in no_fn["reward.overlong_buffer.enable"]
    assert "penalty_factor" in str(_problems(["reward.overlong_buffer.penalty_factor=-1"]))
    load_config("tiny-cpu", ["reward.overlong_buffer.len=99"])  # disabled: the length is not checked


# ---------------------------------------------------------------- extra_info through the reward stage


def test_reward_stage_passes_extra_info_and_response_length() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-llama"))
    seen: list[dict[str, Any] | None] = []

    def recording(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        seen.append(extra_info)
        return float(extra_info["bonus"]) if "bonus" in extra_info else 0.0

    ids = tokenizer("12", add_special_tokens=False)["input_ids"]
    responses = torch.tensor([ids + [0, 0], ids + ids])  # (B=2, R=4): 2 and 4 valid tokens
    infos = np.empty(2, dtype=object)
    infos[:] = [{"bonus": 0.5, "index": 3}, {}]
    data = DataProto.from_dict(
        tensors={"responses": responses, "response_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])},
        non_tensors={"data_source": ["d", "d"], "ground_truth": ["12", "12"], "extra_info": infos},
    )
    stage = RewardStage(tokenizer=tokenizer, reward_fn=recording, reward_model=None)
    stage(data)
    assert seen == [{"bonus": 0.5, "index": 3, "response_length": 2}, {"response_length": 4}]
    torch.testing.assert_close(data.tensors["token_level_scores"], torch.tensor([[0, 0.5, 0, 0], [0, 0, 0, 0.0]]))
    assert infos[0] == {"bonus": 0.5, "index": 3}  # the batch's dicts are copied, not mutated

    # No extra_info column: the function still gets the length; with the overlong penalty on top.
    del data.non_tensor_batch["extra_info"]
    penalised = build_reward_fn("gsm8k", max_response_length=4, overlong_buffer_len=2, overlong_penalty_factor=1.0)
    extra = RewardStage(tokenizer=tokenizer, reward_fn=penalised, reward_model=None)(data)
    # gsm8k strict: "12" has no "####" -> 0; lengths 2 and 4 vs L_max - B = 2: penalties 0 and -1
    assert extra["overlong_reward"] == [0.0, -1.0] and extra["score"] == [0.0, -1.0]


def test_extra_info_dicts_survive_the_batch_operations_of_a_step() -> None:
    # repeat (n samples), pad/chunk (dispatch to ranks), concat (collect), reorder (balance_batch), pickling (Ray).
    import pickle

    infos = np.empty(3, dtype=object)
    infos[:] = [{"i": 0}, {"i": 1}, {}]
    data = DataProto.from_dict(tensors={"x": torch.arange(3)}, non_tensors={"extra_info": infos})
    repeated = data.repeat(2, interleave=True)
    assert list(repeated.non_tensor_batch["extra_info"]) == [{"i": 0}, {"i": 0}, {"i": 1}, {"i": 1}, {}, {}]
    padded, pad = repeated.pad_to_divisor(4)
    parts = [pickle.loads(pickle.dumps(part)) for part in padded.chunk(4)]
    back = DataProto.concat(parts).unpad(pad).reorder([5, 0, 2, 1, 3, 4])
    assert list(back.non_tensor_batch["extra_info"]) == [{}, {"i": 0}, {"i": 1}, {"i": 0}, {"i": 1}, {}]
    assert back.non_tensor_batch["extra_info"].shape == (6,)
