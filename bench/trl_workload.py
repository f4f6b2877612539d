"""The workload both sides of ``bench_vs_trl.py`` train on: prompts and the reward (stdlib only).

Imported by the platform (``reward.reward_fn=bench.trl_workload:compute_score``) and by the TRL side in its
own venv, so the two read the same prompts and score them with the same function.

Task: one-digit additions as chat prompts ("What is 3 + 5? Reply with the number only."); reward 1 when the
first integer of the response is the sum, else 0. SmolLM2-135M-Instruct gets some right from the start, so
GRPO groups carry a signal.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

DATA_SOURCE = "bench_add"
_INT = re.compile(r"-?\d+")


def make_rows(num_rows: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``num_rows`` prompts: ``prompt`` (chat messages), ``ground_truth`` (the sum), ``data_source``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        content = f"What is {a} + {b}? Reply with the number only."
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "ground_truth": str(a + b), "data_source": DATA_SOURCE}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Writes ``rows`` one JSON object per line; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def score(text: str, ground_truth: str) -> float:
    """1.0 when the first integer in ``text`` equals ``ground_truth``, else 0.0."""
    match = _INT.search(text)
    return 1.0 if match is not None and match.group() == ground_truth.strip() else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The platform's (verl's) reward signature."""
    return score(solution_str, ground_truth)


def trl_reward(completions: list[Any], ground_truth: list[str], **_: Any) -> list[float]:
    """TRL's reward signature: conversational completions are ``[{"role": "assistant", "content": ...}]``."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [score(t, g) for t, g in zip(texts, ground_truth, strict=True)]
