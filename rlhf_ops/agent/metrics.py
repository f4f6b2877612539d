"""Per-row counters of a multi-turn rollout and the step metrics built from them (verl's names).

The rollout writes one (B,) tensor per key of :data:`ROW_KEYS` into its output, so the counters travel
with their rows through balancing and splitting; :func:`multi_turn_metrics` reduces them per step:
``num_turns/{mean,max,min}`` (messages of the conversation: the prompt, each model turn and each
observation turn; a single-turn response counts 2), ``tool_call_counts/{mean,max,min}``, and the step's
totals ``multi_turn/tool_errors``, ``multi_turn/tool_timeouts``, ``multi_turn/interaction_turns`` and the
fraction of samples cut by the token budget, ``multi_turn/truncated_ratio``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_ops.agent.tools import SampleState

ROW_KEYS = ("num_turns", "tool_call_counts", "tool_errors", "tool_timeouts", "interaction_turns", "truncated")


def row_counters(states: Sequence[SampleState]) -> dict[str, list[int]]:
    """The (B,) counters of :data:`ROW_KEYS` for B finished samples."""
    return {
        "num_turns": [1 + s.turns + s.observation_turns for s in states],
        "tool_call_counts": [s.tool_calls for s in states],
        "tool_errors": [s.tool_errors for s in states],
        "tool_timeouts": [s.tool_timeouts for s in states],
        "interaction_turns": [s.interaction_turns for s in states],
        "truncated": [int(s.truncated) for s in states],
    }


def multi_turn_metrics(columns: Mapping[str, Any]) -> dict[str, float]:
    """Step metrics from the batch's counter columns (tensors or lists); {} when the batch has none."""
    if "num_turns" not in columns:
        return {}
    values = {k: [float(v) for v in _as_list(columns[k])] for k in ROW_KEYS if k in columns}
    out: dict[str, float] = {}
    for key in ("num_turns", "tool_call_counts"):
        v = values.get(key) or [0.0]
        out.update({f"{key}/mean": sum(v) / len(v), f"{key}/max": max(v), f"{key}/min": min(v)})
    for key in ("tool_errors", "tool_timeouts", "interaction_turns"):
        out[f"multi_turn/{key}"] = sum(values.get(key, []))
    truncated = values.get("truncated") or [0.0]
    out["multi_turn/truncated_ratio"] = sum(truncated) / len(truncated)
    return out


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)
