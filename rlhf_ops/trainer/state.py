"""The trainer's own resume state (besides model and optimizer weights), saved as JSON with each checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """Everything beyond model/optimizer weights that resume needs (saved as JSON)."""

    global_step: int = 0
    loader: dict[str, int] = field(default_factory=dict)
    kl_ctrl: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
