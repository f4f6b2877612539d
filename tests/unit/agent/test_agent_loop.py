"""The agent loop with a scripted model and the real SmolLM2 tokenizer: exact tokens, masks, turns, outputs.

The scripted model answers each sample's turns from a list of texts (each ends with ``<|im_end|>``, the
EOS). SmolLM2's template ignores ``tools=``, so tools are described in a system message and results come
back as ``user`` messages ``<tool_response>...</tool_response>`` (rlhf_ops.agent.chat_format).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from rlhf_ops.agent import (
    AgentLoop,
    AgentLoopConfig,
    AnswerFeedback,
    CalculatorTool,
    Completion,
    SampleState,
    ToolError,
    ToolLimits,
    encode_chat_prompt,
    function_schema,
    multi_turn_metrics,
    row_counters,
)
from rlhf_ops.agent.chat_format import parse_tool_calls, template_renders_tools, with_tools
from tests.support.real_model import smollm2_path

EOS = 2  # <|im_end|>
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


class ScriptedModel:
    """``generate`` for the loop: sample i's k-th turn is ``turns[i][k]`` (+ EOS unless it ends with '…')."""

    def __init__(self, tokenizer: Any, prompts: Sequence[list[int]], turns: Sequence[Sequence[str]]) -> None:
        self.tokenizer, self.prompts, self.turns = tokenizer, [list(p) for p in prompts], turns
        self.seen = [0] * len(prompts)
        self.calls: list[tuple[int, int]] = []  # (sample, budget) per generated turn

    def encode_turn(self, text: str) -> list[int]:
        ids = self.tokenizer(text.removesuffix("…"), add_special_tokens=False)["input_ids"]
        return ids if text.endswith("…") else [*ids, EOS]

    def __call__(self, contexts: list[list[int]], budgets: list[int]) -> list[Completion]:
        out = []
        for context, budget in zip(contexts, budgets, strict=True):
            i = next(k for k, p in enumerate(self.prompts) if context[: len(p)] == p)
            ids = self.encode_turn(self.turns[i][self.seen[i]])[:budget]
            self.seen[i] += 1
            self.calls.append((i, budget))
            out.append(Completion(ids, [-0.5] * len(ids)))
        return out


def _prompt(tokenizer: Any, question: str, tools: Sequence[Any]) -> list[int]:
    return encode_chat_prompt(tokenizer, [{"role": "user", "content": question}], [t.schema() for t in tools])


def _loop(tokenizer: Any, tools: Sequence[Any], **kwargs: Any) -> AgentLoop:
    interaction = kwargs.pop("interaction", None)
    return AgentLoop(
        tokenizer,
        tools={t.name: t for t in tools},
        config=AgentLoopConfig(**{"max_turns": 4, "response_length": 200, **kwargs}),
        eos_token_ids=[EOS],
        interaction=interaction,
    )


def _obs(tokenizer: Any, content: str) -> list[int]:
    """Hand-written observation: ChatML's newline after the model's <|im_end|>, a user turn, the header."""
    text = f"\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_smollm2_template_ignores_tools_so_the_system_prompt_describes_them(tokenizer: Any) -> None:
    assert not template_renders_tools(tokenizer)
    prompt = tokenizer.decode(_prompt(tokenizer, "What is 6*7?", [CalculatorTool()]))
    assert prompt.startswith("<|im_start|>system\nYou may call tools")  # replaces SmolLM2's default system line
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_tool_call_then_answer_gives_exact_tokens_and_mask_with_a_hole(tokenizer: Any) -> None:
    calc = CalculatorTool()
    prompt = _prompt(tokenizer, "What is 6*7?", [calc])
    model = ScriptedModel(tokenizer, [prompt], [[CALC, "6*7 = 42.\n#### 42"]])
    [sample] = _loop(tokenizer, [calc]).run([prompt], model)
    turn1, turn2 = model.encode_turn(CALC), model.encode_turn("6*7 = 42.\n#### 42")
    observation = _obs(tokenizer, "42")
    assert sample.response_ids == turn1 + observation + turn2
    assert sample.response_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert sample.logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.5] * len(turn2)
    # The whole transcript is exactly what the chat template renders for the conversation.
    messages = with_tools([{"role": "user", "content": "What is 6*7?"}], [calc.schema()])
    messages += [
        {"role": "assistant", "content": CALC},
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
        {"role": "assistant", "content": "6*7 = 42.\n#### 42"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == tokenizer.decode(prompt + sample.response_ids) + "\n"  # the template's closing newline
    state = sample.state
    assert (state.turns, state.tool_calls, state.tool_errors, state.observation_turns) == (2, 1, 0, 1)
    assert model.calls == [(0, 200), (0, 200 - len(turn1) - len(observation))]  # the budget shrinks per turn


class Boom:
    name = "boom"

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "raises", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        raise RuntimeError("kaput")


class Sleepy:
    name = "sleepy"

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "hangs", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        time.sleep(30)
        return "never"


class Chatty:
    name = "chatty"

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "talks a lot", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        return "word " * 500


class Picky:
    name = "picky"

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "refuses", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        raise ToolError("x must be positive")


@pytest.mark.parametrize(
    ("call", "error", "timeouts"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "is not valid JSON", 0),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}', "is not closed", 0),
        ('<tool_call>["calculator"]</tool_call>', 'must be {"name"', 0),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'", 0),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>',
            "unsupported",
            0,
        ),
        ('<tool_call>{"name": "boom", "arguments": {}}</tool_call>', "raised RuntimeError: kaput", 0),
        ('<tool_call>{"name": "picky", "arguments": {}}</tool_call>', "Error: x must be positive", 0),
        ('<tool_call>{"name": "sleepy", "arguments": {}}</tool_call>', "timed out after 0.2 s", 1),
        ('<tool_call>{"name": "chatty", "arguments": {}}</tool_call>', "[Error: output cut at 64 tokens]", 0),
    ],
)
def test_bad_tool_calls_become_error_observations(tokenizer: Any, call: str, error: str, timeouts: int) -> None:
    tools = [CalculatorTool(), Boom(), Sleepy(), Chatty(), Picky()]
    prompt = _prompt(tokenizer, "Go", tools)
    model = ScriptedModel(tokenizer, [prompt], [[call, "done"]])
    loop = _loop(tokenizer, tools, max_tool_response_tokens=64, limits=ToolLimits(timeout_s=0.2))
    started = time.perf_counter()
    [sample] = loop.run([prompt], model)
    assert time.perf_counter() - started < 5  # the hung tool is abandoned, not awaited
    first = len(model.encode_turn(call))
    observation = [t for t, m in zip(sample.response_ids[first:], sample.response_mask[first:], strict=True) if not m]
    assert error in tokenizer.decode(observation)
    assert sample.response_mask[-2:] == [1, 1]  # the model got its next turn ("done" + EOS)
    state = sample.state
    assert (state.turns, state.tool_calls, state.tool_errors, state.tool_timeouts) == (2, 1, 1, timeouts)


def test_max_turns_stops_a_model_that_keeps_calling_tools(tokenizer: Any) -> None:
    calc = CalculatorTool()
    prompt = _prompt(tokenizer, "Loop", [calc])
    model = ScriptedModel(tokenizer, [prompt], [[CALC] * 5])
    [sample] = _loop(tokenizer, [calc], max_turns=3, response_length=1000).run([prompt], model)
    turn, observation = model.encode_turn(CALC), _obs(tokenizer, "42")
    # 3 model turns, 2 observations: the third turn's call is counted but never run.
    assert sample.response_ids == turn + observation + turn + observation + turn
    assert sample.response_mask == ([1] * len(turn) + [0] * len(observation)) * 2 + [1] * len(turn)
    state = sample.state
    assert (state.turns, state.tool_calls, state.observation_turns, state.truncated) == (3, 3, 2, False)


def test_budget_cuts_the_response_and_flags_truncation(tokenizer: Any) -> None:
    calc = CalculatorTool()
    prompt = _prompt(tokenizer, "Long", [calc])
    turn = ScriptedModel(tokenizer, [], []).encode_turn(CALC)
    budget = len(turn) + 5  # the observation does not fit: cut to the 5 columns left, no model turn after it
    model = ScriptedModel(tokenizer, [prompt], [[CALC, "never generated"]])
    [sample] = _loop(tokenizer, [calc], response_length=budget).run([prompt], model)
    assert sample.response_ids == turn + _obs(tokenizer, "42")[:5]
    assert sample.response_mask == [1] * len(turn) + [0] * 5
    assert sample.state.truncated and sample.state.turns == 1 and len(model.calls) == 1


def test_turn_cut_mid_way_ends_the_episode(tokenizer: Any) -> None:
    prompt = _prompt(tokenizer, "Cut", [CalculatorTool()])
    model = ScriptedModel(tokenizer, [prompt], [["a very long answer that goes on and on and on"]])
    [sample] = _loop(tokenizer, [CalculatorTool()], response_length=4).run([prompt], model)
    assert len(sample.response_ids) == 4 and sample.response_mask == [1, 1, 1, 1] and sample.state.truncated


def test_interaction_answers_a_wrong_answer_and_the_model_retries(tokenizer: Any) -> None:
    prompt = encode_chat_prompt(tokenizer, [{"role": "user", "content": "2+2?"}], [])
    model = ScriptedModel(tokenizer, [prompt], [["#### 5", "#### 4"]])
    loop = _loop(tokenizer, [], interaction=AnswerFeedback(max_replies=2))
    [sample] = loop.run([prompt], model, rows=[{"ground_truth": "4"}])
    reply = "That is not correct. Check your calculation and answer again, ending with '#### <number>'."
    env = tokenizer(f"\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    first, second = model.encode_turn("#### 5"), model.encode_turn("#### 4")
    assert sample.response_ids == first + env["input_ids"] + second
    assert sample.response_mask == [1] * len(first) + [0] * len(env["input_ids"]) + [1] * len(second)
    assert (sample.state.turns, sample.state.interaction_turns) == (2, 1)


def test_samples_run_independently_and_metrics_use_verl_names(tokenizer: Any) -> None:
    calc = CalculatorTool()
    prompts = [_prompt(tokenizer, q, [calc]) for q in ("one", "two", "three")]
    turns = [["#### 1"], [CALC, "#### 42"], [CALC, CALC.replace("6*7", "1/0"), "#### 0"]]
    model = ScriptedModel(tokenizer, prompts, turns)
    samples = _loop(tokenizer, [calc]).run(prompts, model)
    assert [s.state.turns for s in samples] == [1, 2, 3]
    assert [s.state.tool_errors for s in samples] == [0, 0, 1]  # division by zero is an error observation
    metrics = multi_turn_metrics(row_counters([s.state for s in samples]))
    # num_turns = prompt + model turns + observations: 1+1+0 = 2, 1+2+1 = 4, 1+3+2 = 6 -> mean 4
    assert metrics["num_turns/mean"] == pytest.approx(4.0)
    assert (metrics["num_turns/max"], metrics["num_turns/min"]) == (6, 2)
    assert (metrics["tool_call_counts/mean"], metrics["tool_call_counts/max"], metrics["tool_call_counts/min"]) == (
        1.0,
        2,
        0,
    )
    assert (metrics["multi_turn/tool_errors"], metrics["multi_turn/tool_timeouts"]) == (1, 0)
    # Round 1 runs all three samples, round 2 the two with tool calls, round 3 the last one.
    assert [i for i, _ in model.calls] == [0, 1, 2, 1, 2, 2]


def test_dataset_prompts_describe_the_tools_when_given(tokenizer: Any) -> None:
    from rlhf_ops.data.dataset import encode_prompt

    messages = [{"role": "user", "content": "What is 6*7?"}]
    schemas = [CalculatorTool().schema()]
    with_schemas = encode_prompt(messages, tokenizer, apply_chat_template=True, tools=schemas)
    assert with_schemas == encode_chat_prompt(tokenizer, messages, schemas)
    plain = encode_prompt(messages, tokenizer, apply_chat_template=True)
    assert "You may call tools" not in tokenizer.decode(plain)
    assert "You may call tools" in tokenizer.decode(with_schemas)


def test_example_tool_prompt_shows_one_worked_calculator_call_before_the_question(tokenizer: Any) -> None:
    from rlhf_ops.agent.tools import tool_examples
    from rlhf_ops.data.dataset import encode_prompt

    calc = CalculatorTool()
    [example] = tool_examples({"calculator": calc, "boom": Boom()})  # Boom has no example()
    assert (example.name, example.arguments, example.result) == ("calculator", {"expression": "3 * 4"}, "12")
    messages = [{"role": "user", "content": "What is 6*7?"}]
    ids = encode_prompt(messages, tokenizer, apply_chat_template=True, tools=[calc.schema()], tool_examples=[example])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'
    system = with_tools(messages, [calc.schema()])[0]["content"]
    expected = (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nKim has 3 bags with 4 pens in each bag. How many pens does Kim have?<|im_end|>\n"
        f"<|im_start|>assistant\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nKim has 3 * 4 = 12 pens.<|im_end|>\n"
        "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(ids) == expected
    # The example's call is one the loop parses, and its result is what the calculator returns for it.
    [parsed] = parse_tool_calls(call)
    assert calc.call(parsed.arguments, SampleState(index=0)) == example.result
    # Without examples the prompt is the schemas-only one.
    assert encode_prompt(messages, tokenizer, apply_chat_template=True, tools=[calc.schema()]) == encode_chat_prompt(
        tokenizer, messages, [calc.schema()]
    )
