"""Conversations encoded for SFT: the exact loss mask, and the agent loop's own token layout.

The tiny tokenizer is char-level (one token per character; ``<bos>``, ``<eos>``, ``<|user|>``, ``<|assistant|>``
are single tokens), so the expected masks are counted by hand. SmolLM2's tokenizer shows the layout equals what
the agent loop builds when a model writes the same turns.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_ops.agent import AgentLoop, AgentLoopConfig, CalculatorTool, Completion, encode_chat_prompt
from rlhf_ops.agent.tools import tool_examples
from rlhf_ops.agent.transcript import conversation_problem, encode_conversation
from rlhf_ops.data.tool_sft import make_calculator_transcripts
from rlhf_ops.models.tiny import build_tiny_tokenizer
from tests.support.real_model import smollm2_path


@pytest.fixture(scope="module")
def tiny() -> Any:
    return build_tiny_tokenizer()


def test_the_mask_is_one_exactly_on_assistant_tokens_and_their_eos(tiny: Any) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
    ]
    ids, mask = encode_conversation(tiny, messages, eos_token_id=tiny.eos_token_id)
    # prompt "<bos><|user|>hi\n<|assistant|>": 1 + 1 + 2 + 1 + 1 = 6 tokens, masked out
    # turn "ok<eos>": 3 tokens, learned
    # reply: the template's close after the model's <eos> ("\n", as <eos> is not the template's own closing text),
    #   then "<|user|>x\n<|assistant|>": 1 + 1 + 1 + 1 + 1 = 5 tokens, masked out
    # turn "y<eos>": 2 tokens, learned
    assert mask == [0] * 6 + [1] * 3 + [0] * 5 + [1] * 2
    assert tiny.decode(ids) == "<bos><|user|>hi\n<|assistant|>ok<eos>\n<|user|>x\n<|assistant|>y<eos>"


def test_a_tool_result_is_an_observation_and_a_trailing_message_is_dropped(tiny: Any) -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "c"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "a 7"},
        {"role": "user", "content": "thanks"},
    ]
    ids, mask = encode_conversation(tiny, messages, eos_token_id=tiny.eos_token_id)
    learned = tiny.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert learned == "c<eos>a 7<eos>"
    # the tool result comes back as a user message "<tool_response>\n7\n</tool_response>" (the tiny alphabet has no
    # '<', '/' or '_': those characters are <unk>), between the two turns, masked out
    text = tiny.decode(ids)
    assert text.startswith("<bos><|system|>s\n<|user|>q\n<|assistant|>c<eos>\n<|user|>")
    assert text.endswith("\n7\n<unk><unk>tool<unk>response>\n<|assistant|>a 7<eos>")
    assert sum(mask) == 6 and len(ids) == len(mask)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "non-empty list"),
        ([{"role": "user", "content": "q"}], "no assistant turn"),
        ([{"role": "assistant", "content": "a"}], "the first message has role 'assistant'"),
        (
            [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}],
            "message 1 must be a mapping with a role",
        ),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}], "message 0 (user) must have string"),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "1"},
                {"role": "assistant", "content": "a"},
            ],
            "tool message comes before",
        ),
    ],
)
def test_malformed_conversations_are_named(messages: Any, problem: str) -> None:
    found = conversation_problem(messages)
    assert found is not None and problem in found, found


def test_sft_layout_equals_the_agent_loop_s_for_the_same_turns() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    calculator = CalculatorTool()
    schemas, examples = [calculator.schema()], tool_examples({"calculator": calculator})
    for row in make_calculator_transcripts(3, seed=5):
        ids, mask = encode_conversation(tokenizer, row["messages"], eos_token_id=2, schemas=schemas, examples=examples)
        prompt = encode_chat_prompt(tokenizer, row["messages"][:1], schemas, examples)
        turns = iter(m["content"] for m in row["messages"] if m["role"] == "assistant")

        def generate(contexts: list[list[int]], budgets: list[int], turns: Any = turns) -> list[Completion]:
            del budgets
            out = []
            for _ in contexts:
                turn = [*tokenizer(next(turns), add_special_tokens=False)["input_ids"], 2]  # 2 = <|im_end|>
                out.append(Completion(turn, [0.0] * len(turn)))
            return out

        loop = AgentLoop(
            tokenizer,
            tools={"calculator": calculator},
            config=AgentLoopConfig(max_turns=3, response_length=200),
            eos_token_ids=[2],
        )
        (sample,) = loop.run([prompt], generate)
        assert sample.state.tool_calls == 1 and sample.state.tool_errors == 0
        assert ids == prompt + sample.response_ids
        assert mask == [0] * len(prompt) + sample.response_mask
