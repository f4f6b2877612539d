"""One rollout request of a test: prompts plus the settings to sample them with, passed the way the worker does.

Engines take their settings as typed arguments (``sampling``, ``step``), never from ``meta_info``; a test names
only the settings it changes from the engine's defaults (which differ per engine: eos ids, response length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Call:
    """``prompts`` sampled with the engine's defaults overridden by ``settings`` (SamplingParams fields)."""

    prompts: DataProto
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    step: int | None = None


def sampling_for(engine: Any, **settings: Any) -> SamplingParams:
    """``engine.defaults`` with ``settings`` replaced (an eos list becomes a tuple)."""
    if isinstance(settings.get("eos_token_id"), Sequence):
        settings["eos_token_id"] = tuple(settings["eos_token_id"])
    defaults: SamplingParams = engine.defaults
    return dataclasses.replace(defaults, **settings)


def generate(engine: Any, call: Call) -> DataProto:
    """``engine.generate_sequences`` for ``call``."""
    out: DataProto = engine.generate_sequences(call.prompts, sampling_for(engine, **call.settings), call.step)
    return out
