"""User-defined tools for the registry tests, named by dotted path like a user's package would be."""

from __future__ import annotations

from typing import Any

from rlhf_ops.agent import SampleState, ToolLimits, function_schema


class Counter:
    """Counts its calls per sample (``state.data``): the per-sample state example."""

    name = "counter"

    def __init__(self, limits: ToolLimits) -> None:
        self.limits = limits

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "counts its calls", {}, [])

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        state.data["count"] = state.data.get("count", 0) + 1
        return str(state.data["count"])


def needs_arguments(x: int) -> int:
    """Not a tool factory: it cannot be called with no arguments."""
    return x
