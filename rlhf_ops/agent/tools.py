"""The tool contract of multi-turn rollouts, per-sample state, and the in-process tool runner.

A tool is an object with a ``name``, an OpenAI-style function ``schema()`` (what the model is told) and
``call(arguments, state) -> str`` (the observation text the model reads next). Tools never crash a
rollout step: :func:`run_tool` turns an unknown name, bad arguments, an exception, a call past its time
limit and an over-long output into an error observation and counts it in the sample's state.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

TIMEOUT_GRACE_S = 1.0
"""Seconds past ``timeout_s`` before a call that did not return is abandoned."""


class ToolError(Exception):
    """Raised by a tool for a bad call; its message becomes the observation (``Error: <message>``)."""


@dataclasses.dataclass(kw_only=True)
class SampleState:
    """What the agent loop knows about one sample (one response row) while it runs.

    Tools and interactions may keep their own per-sample data in :attr:`data` (a sandbox session, a
    game board); the counters feed the step's metrics.
    """

    index: int
    """Row of the sample in the rollout batch."""
    row: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The row's non-tensor columns (``ground_truth``, ``data_source``, ``extra_info``...)."""
    turns: int = 0
    """Model (assistant) turns generated so far."""
    tool_calls: int = 0
    """Tool calls the model made (well-formed or not)."""
    tool_errors: int = 0
    """Calls that produced an error observation (malformed, unknown tool, exception, over-long output)."""
    tool_timeouts: int = 0
    """Calls stopped at their time limit (also counted in :attr:`tool_errors`)."""
    interaction_turns: int = 0
    """Environment (user) replies from the interaction."""
    observation_turns: int = 0
    """Observations appended (one per answered model turn: its tool results, or the environment's reply)."""
    truncated: bool = False
    """The response hit the token budget before the model finished."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free per-sample storage for tools and interactions."""


@runtime_checkable
class Tool(Protocol):
    """A function the model can call."""

    name: str

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling schema: ``{"type": "function", "function": {"name", "description",
        "parameters": <JSON Schema>}}``."""
        ...

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        """Runs the tool; returns the observation text. Raise :class:`ToolError` for a bad call."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolExample:
    """One worked call of a tool, shown to the model as chat turns before its own question
    (``rollout.multi_turn.tool_prompt=example``): the question, the call, the tool's result, the final answer.

    A tool offers one through an optional ``example() -> ToolExample`` method (the built-in calculator does).
    """

    name: str
    """The tool's name (what the call names)."""
    question: str
    arguments: dict[str, Any]
    result: str
    """What the tool returns for ``arguments``."""
    answer: str
    """The model's turn after the result."""


def tool_examples(tools: Mapping[str, Any]) -> list[ToolExample]:
    """The worked examples of the tools that offer one (an ``example()`` method), in the tools' order."""
    return [tool.example() for tool in tools.values() if callable(getattr(tool, "example", None))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolLimits:
    """Limits every tool call runs under (``rollout.multi_turn``)."""

    timeout_s: float = 5.0
    """Wall-clock limit of one call; past it (plus :data:`TIMEOUT_GRACE_S`) the observation says so and the call
    is abandoned."""
    max_output_chars: int = 2000
    """Longer outputs are cut and marked (the token limit applies after this, on the rendered text)."""


def function_schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """Builds the OpenAI function schema of a tool with an object of ``properties``."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _call_with_timeout(tool: Tool, arguments: dict[str, Any], state: SampleState, timeout_s: float) -> tuple[str, str]:
    """("ok" | "error" | "timeout", text). A hung call keeps its daemon thread; the rollout moves on."""
    result: dict[str, tuple[str, str]] = {}

    def target() -> None:
        try:
            result["out"] = ("ok", str(tool.call(arguments, state)))
        except ToolError as err:
            result["out"] = ("error", f"Error: {err}")
        except Exception as err:  # a tool's bug is an observation, never a crashed step
            result["out"] = ("error", f"Error: tool {tool.name!r} raised {type(err).__name__}: {err}")

    worker = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    worker.start()
    # A tool that enforces the limit itself (the sandbox kills its process) reports first; the grace only
    # matters for one that hangs.
    worker.join(timeout_s + TIMEOUT_GRACE_S)
    if worker.is_alive() or "out" not in result:
        return "timeout", f"Error: tool {tool.name!r} timed out after {timeout_s:g} s."
    return result["out"]


def run_tool(tools: Mapping[str, Tool], name: str, arguments: Any, state: SampleState, limits: ToolLimits) -> str:
    """Runs one parsed call and returns the observation text; every failure is counted in ``state``."""
    if name not in tools:
        state.tool_errors += 1
        return f"Error: unknown tool {name!r}; available tools: {sorted(tools)}."
    if not isinstance(arguments, dict):
        state.tool_errors += 1
        return f"Error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
    status, text = _call_with_timeout(tools[name], arguments, state, limits.timeout_s)
    if status != "ok":
        state.tool_errors += 1
        state.tool_timeouts += status == "timeout"
    if len(text) > limits.max_output_chars:
        state.tool_errors += status == "ok"
        text = text[: limits.max_output_chars] + f"\n[output cut at {limits.max_output_chars} characters]"
    return text
