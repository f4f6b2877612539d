"""The data path with the real SmolLM2-135M-Instruct tokenizer: chat template, and pad == eos (id 2).

SmolLM2's ``<|im_end|>`` (id 2) is EOS *and* pad, and it also closes every chat turn inside the prompt.
So nothing may derive a mask from ``ids != pad_token_id``: prompt masks come from the dataset, response
masks from :func:`rlhf_ops.padding.get_response_mask` (first EOS kept, everything after it masked).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rlhf_ops.data.dataset import PromptDataset, encode_prompt
from rlhf_ops.padding import get_response_mask
from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.reward import RewardStage
from tests.support.real_model import smollm2_path

EOS = PAD = 2
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def test_real_tokenizer_has_pad_equal_eos(tokenizer: Any) -> None:
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.eos_token) == (PAD, EOS, "<|im_end|>")


def test_chat_messages_get_the_template_and_the_generation_prompt(tokenizer: Any) -> None:
    ids = encode_prompt([{"role": "user", "content": "What is 2+3?"}], tokenizer, apply_chat_template=True)
    # The template adds SmolLM2's default system turn and ends with the assistant header, so the model's
    # first sampled token is the answer's, not a role name.
    expected = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(ids) == expected
    assert ids[-4:] == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids.count(EOS) == 2  # two closed turns: the in-prompt <|im_end|> tokens are real tokens
    # Without the template (apply_chat_template=False) the turns are joined as plain text.
    plain = encode_prompt([{"role": "user", "content": "What is 2+3?"}], tokenizer, apply_chat_template=False)
    assert tokenizer.decode(plain) == "What is 2+3?"


def test_left_padding_with_the_eos_id_keeps_in_prompt_eos_tokens_attended(tokenizer: Any, tmp_path: Any) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": [{"role": "user", "content": "Hi"}], "ground_truth": "x"}\n'
        '{"prompt": [{"role": "user", "content": "What is the capital of France?"}], "ground_truth": "y"}\n'
    )
    data = PromptDataset.from_sources([str(rows)], tokenizer, max_prompt_length=64)
    batch = data.batch([0, 1], pad_token_id=PAD, uid_prefix="t")
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    short, long = len(data.prompt_ids[0]), len(data.prompt_ids[1])
    assert ids.shape == (2, long) and long > short
    assert ids[0, : long - short].eq(PAD).all() and mask[0, : long - short].eq(0).all()  # left padding
    assert mask.sum(-1).tolist() == [short, long]  # every real token attended, its two EOS ids included
    assert (ids.eq(EOS) & mask.bool()).sum(-1).tolist() == [2, 2]


def test_the_ending_eos_stays_in_the_mask_and_carries_the_reward(tokenizer: Any) -> None:
    answer = tokenizer("Paris", add_special_tokens=False)["input_ids"]
    n = len(answer)
    # A response that ends with EOS at column n, then pad (== EOS) to R = n + 3; a truncated one (no EOS).
    responses = torch.tensor([[*answer, EOS, PAD, PAD], [*answer, *answer[:1], 100, 101]])
    mask = get_response_mask(responses, eos_token_id=EOS)
    assert mask.tolist() == [[1] * (n + 1) + [0, 0], [1] * (n + 3)]
    seen: list[str] = []

    def reward_fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        seen.append(solution_str)
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    data = DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        non_tensors={
            "data_source": np.array(["t", "t"], dtype=object),
            "ground_truth": np.array(["Paris"] * 2, dtype=object),
        },
    )
    RewardStage(tokenizer=tokenizer, reward_fn=reward_fn, reward_model=None)(data)
    scores = data.tensors["token_level_scores"]
    assert seen[0] == "Paris"  # the text the function sees: the EOS is a special token, skipped in decoding
    # The score sits on the EOS (column n), the last token the policy chose; the pads after it get none.
    assert scores[0].tolist() == [0.0] * n + [1.0, 0.0, 0.0]
    assert scores[1, -1].item() == 0.0 and scores.sum().item() == 1.0
