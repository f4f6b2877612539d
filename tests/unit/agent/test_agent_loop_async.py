"""The per-sample schedule (``AgentLoop.arun``: one coroutine per sample) against the rounds (``AgentLoop.run``).

A scripted engine serves both schedules from one script (sample i's k-th turn is ``turns[i][k]``, as in
``test_agent_loop.py``), so the two runs see the same model outputs: their tokens, masks, log-probs and counters
must be identical. The scheduling itself is shown by the order of the engine's requests: with a slow tool on one
sample, the other samples' later turns reach the engine before that tool returns (and, in rounds, after it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from rlhf_ops.agent import (
    AgentLoop,
    AgentSample,
    AnswerFeedback,
    CalculatorTool,
    Completion,
    SampleState,
    ToolLimits,
    encode_chat_prompt,
    function_schema,
    multi_turn_metrics,
    row_counters,
)
from tests.unit.agent.test_agent_loop import CALC, Boom, Chatty, ScriptedModel, Sleepy, _loop, _prompt, tokenizer

__all__ = ["tokenizer"]  # the module-scoped SmolLM2 tokenizer fixture


class Gate:
    """A slow tool: waits until the gate opens (or ``wait_s``), then returns the same text either way."""

    name = "gate"

    def __init__(self, log: list[tuple[str, int, int]], wait_s: float) -> None:
        self.log, self.wait_s = log, wait_s
        self.opened = threading.Event()
        self.released_early: bool | None = None

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "slow", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        self.released_early = self.opened.wait(timeout=self.wait_s)
        self.log.append(("tool returns", state.index, state.turns))
        return "gate open"


class ScriptedEngine:
    """Both engine forms over one :class:`ScriptedModel`; logs ("request", sample, turn) as requests arrive.

    ``open_gate_at``: the (sample, turn) request that opens ``gate`` (the slow tool's release).
    """

    def __init__(
        self,
        model: ScriptedModel,
        log: list[tuple[str, int, int]],
        *,
        gate: Gate | None = None,
        open_gate_at: tuple[int, int] | None = None,
        delay_s: float = 0.01,
    ) -> None:
        self.model, self.log, self.gate, self.open_gate_at, self.delay_s = model, log, gate, open_gate_at, delay_s

    def _arrive(self, index: int) -> None:
        turn = self.model.seen[index]
        self.log.append(("request", index, turn))
        if self.gate is not None and (index, turn) == self.open_gate_at:
            self.gate.opened.set()

    def _sample_of(self, context: list[int]) -> int:
        return next(k for k, p in enumerate(self.model.prompts) if context[: len(p)] == p)

    def generate(self, contexts: list[list[int]], budgets: list[int]) -> list[Completion]:
        """Rounds: one call per round."""
        for context in contexts:
            self._arrive(self._sample_of(context))
        return self.model(contexts, budgets)

    async def agenerate(self, index: int, context: list[int], budget: int) -> Completion:
        """Per sample: one call per turn, "decoding" for ``delay_s`` on the event loop."""
        assert self._sample_of(context) == index
        self._arrive(index)
        await asyncio.sleep(self.delay_s)
        self.log.append(("done", index, self.model.seen[index]))
        [completion] = self.model([context], [budget])
        return completion


def _same(a: Sequence[AgentSample], b: Sequence[AgentSample]) -> None:
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_mask for s in a] == [s.response_mask for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert row_counters([s.state for s in a]) == row_counters([s.state for s in b])
    assert multi_turn_metrics(row_counters([s.state for s in a])) == multi_turn_metrics(
        row_counters([s.state for s in b])
    )


SLOW = '<tool_call>{"name": "gate", "arguments": {}}</tool_call>'
BAD = '<tool_call>{"name": "calculator", "arguments": </tool_call><tool_call>{"name": "search"}</tool_call>'
TURNS = [
    [SLOW, "#### 1"],  # sample 0: one slow tool call
    [CALC, CALC, "#### 42"],  # sample 1: two fast tool calls, three turns
    [BAD, "done"],  # sample 2: a malformed call and an unknown tool (error observations), then an answer
]


def _run_both(tokenizer: Any, wait_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule in ("per_sample", "rounds"):
        log: list[tuple[str, int, int]] = []
        gate = Gate(log, wait_s)
        tools = [CalculatorTool(), gate]
        prompts = [_prompt(tokenizer, q, tools) for q in ("slow", "fast", "bad")]
        engine = ScriptedEngine(ScriptedModel(tokenizer, prompts, TURNS), log, gate=gate, open_gate_at=(1, 2))
        loop = _loop(tokenizer, tools)
        if schedule == "per_sample":
            samples = asyncio.run(loop.arun(prompts, engine.agenerate))
        else:
            samples = loop.run(prompts, engine.generate)
        out[schedule] = {"samples": samples, "log": log, "gate": gate}
    return out


def test_a_slow_tool_does_not_block_the_other_samples_turns(tokenizer: Any) -> None:
    runs = _run_both(tokenizer, wait_s=1.0)
    per_sample, rounds = runs["per_sample"], runs["rounds"]
    log = per_sample["log"]
    slow_returns = log.index(("tool returns", 0, 1))
    # The fast sample's turn 2 and turn 3 requests reach the engine while the slow sample's tool still runs
    # (turn 3's request is what opens the gate: the tool returned early, it did not wait its 1 s out).
    assert log.index(("request", 1, 1)) < log.index(("request", 1, 2)) < slow_returns
    assert per_sample["gate"].released_early is True
    assert log.index(("request", 2, 1)) < slow_returns  # the bad-input sample's next turn too
    assert log.index(("request", 0, 1)) > slow_returns  # the slow sample's own next turn waits for its tool
    # Continuous batching: every first turn is submitted before any finishes.
    assert [e for e in log if e[0] in ("request", "done")][:3] == [("request", i, 0) for i in range(3)]
    # In rounds, turn 2 of every sample waits for the round's slowest tool (the gate's full 1 s).
    rlog = rounds["log"]
    assert rlog.index(("tool returns", 0, 1)) < rlog.index(("request", 1, 1))
    assert rounds["gate"].released_early is False
    # Same model outputs, same results: tokens, masks, log-probs, turns, tool calls, errors, metrics.
    _same(per_sample["samples"], rounds["samples"])
    counters = row_counters([s.state for s in per_sample["samples"]])
    assert counters["num_turns"] == [1 + 2 + 1, 1 + 3 + 2, 1 + 2 + 1]  # prompt + model turns + observations
    assert counters["tool_call_counts"] == [1, 2, 2] and counters["tool_errors"] == [0, 0, 2]
    bad = per_sample["samples"][2]
    first = len(ScriptedModel(tokenizer, [], []).encode_turn(BAD))
    observation = tokenizer.decode([t for t, m in zip(bad.response_ids, bad.response_mask, strict=True) if not m])
    assert bad.response_mask[first - 1] == 1 and "is not valid JSON" in observation
    assert "unknown tool 'search'" in observation and bad.response_mask[-1] == 1  # the model answered after it


def test_bad_tools_and_interactions_give_the_same_results_in_both_schedules(tokenizer: Any) -> None:
    tools = [CalculatorTool(), Boom(), Sleepy(), Chatty()]
    calls = {name: f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' for name in ("boom", "sleepy")}
    chatty = '<tool_call>{"name": "chatty", "arguments": {}}</tool_call>'
    prompts = [_prompt(tokenizer, q, tools) for q in ("a", "b", "c", "d")]
    turns = [[calls["boom"], "x"], [calls["sleepy"], "y"], [chatty, "z"], ["#### 5", "#### 4"]]
    rows = [{"ground_truth": "4"}] * 4
    results = {}
    for schedule in ("per_sample", "rounds"):
        log: list[tuple[str, int, int]] = []
        engine = ScriptedEngine(ScriptedModel(tokenizer, prompts, turns), log)
        loop = _loop(
            tokenizer,
            tools,
            interaction=AnswerFeedback(),
            max_turns=2,
            max_tool_response_tokens=64,
            limits=ToolLimits(timeout_s=0.2),
        )
        if schedule == "per_sample":
            results[schedule] = asyncio.run(loop.arun(prompts, engine.agenerate, rows=rows))
        else:
            results[schedule] = loop.run(prompts, engine.generate, rows=rows)
    _same(results["per_sample"], results["rounds"])
    counters = row_counters([s.state for s in results["per_sample"]])
    assert counters["tool_errors"] == [1, 1, 1, 0] and counters["tool_timeouts"] == [0, 1, 0, 0]
    assert counters["interaction_turns"] == [0, 0, 0, 1]  # "#### 5" is wrong: the grader replies once
    errors = ("raised RuntimeError", "timed out", "output cut")
    for sample, text in zip(results["per_sample"][:3], errors, strict=True):
        observation = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if not m]
        assert text in tokenizer.decode(observation)


def test_an_engine_error_in_one_sample_stops_the_episodes_and_is_raised(tokenizer: Any) -> None:
    prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": q}], []) for q in ("a", "b")]
    started: list[int] = []

    async def generate(index: int, context: list[int], budget: int) -> Completion:
        started.append(index)
        if index == 1:
            raise RuntimeError("vLLM request 7 ended without a finished output.")
        await asyncio.sleep(30)  # cancelled when sample 1 fails
        return Completion([], [])

    loop = AgentLoop(tokenizer, tools={}, config=_loop(tokenizer, []).config, eos_token_ids=[2])
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="ended without a finished output"):
        asyncio.run(loop.arun(prompts, generate))
    assert sorted(started) == [0, 1] and time.perf_counter() - start < 5
