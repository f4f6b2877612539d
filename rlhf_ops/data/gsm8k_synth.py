"""``builtin:gsm8k_synth``: procedurally generated grade-school word problems in GSM8K's format.

No data set can be downloaded on the training machines, so this generates one: templates of one or two
operations (addition, subtraction, multiplication) on small numbers, e.g. "Tom has 7 apples. He buys 5
more. How many apples does Tom have now?", each with a GSM8K-style worked answer ending in ``#### 12``.

Rows are in verl's Parquet layout (``prompt`` as chat messages, ``data_source``, ``ability``,
``reward_model: {style, ground_truth}``, ``extra_info: {split, index, question, answer, num_ops}``), so
the ``gsm8k`` and ``default`` rewards score them and ``rlhf prepare-data`` reads them like a verl file.

Train and held-out sets are disjoint by construction: a question belongs to the held-out split iff the
sha256 of its text falls in the lowest :data:`HELDOUT_SHARE` of the hash range, whatever the seed, so
the two sets can never share a question (``builtin:gsm8k_synth`` is the train split,
``builtin:gsm8k_synth_test`` the held-out one). Within a set questions are distinct.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any, Literal

GSM8K_SYNTH_SOURCE = "synth/gsm8k"
HELDOUT_SHARE = 0.2
MAX_ROWS = 100_000  # per set; the question space holds millions, but drawing many distinct ones slows down
# No example number in the instruction: SmolLM2 copies one ("#### 42") instead of its own result. No "step by
# step" either: with it SmolLM2-135M-Instruct rambles past its result (200 held-out prompts, greedy, 96 tokens:
# 8.5% right, 55% of responses cut at the limit; with this instruction 17.5% right, 12% cut, half the tokens).
INSTRUCTION = "Write the final answer as a number after '####'."
Split = Literal["train", "test"]

_PEOPLE = [
    ("Tom", "He"), ("Anna", "She"), ("Liam", "He"), ("Mia", "She"), ("Noah", "He"), ("Emma", "She"),
    ("Ben", "He"), ("Lily", "She"), ("Sam", "He"), ("Zoe", "She"), ("Omar", "He"), ("Sara", "She"),
]  # fmt: skip
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "balloons", "cards", "shells", "stamps"]


class _Problem:
    """One drawn problem: question, worked answer (GSM8K style, ``<<a+b=c>>`` calculator notes), answer."""

    def __init__(self, question: str, steps: list[tuple[str, str, int]], answer: int) -> None:
        self.question, self.answer = question, answer
        # steps: (sentence before the result, expression, value) -> "... 7 + 5 = <<7+5=12>>12 ..."
        lines = [f"{text} {expr} = <<{expr.replace(' ', '')}={value}>>{value}." for text, expr, value in steps]
        self.solution = "\n".join([*lines, f"#### {answer}"])


def _add(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    q = f"{who} has {a} {item}. {he} buys {b} more. How many {item} does {who} have now?"
    return _Problem(q, [(f"{who} has", f"{a} + {b}", a + b)], a + b)


def _sub(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a = rng.randint(6, 25)
    b = rng.randint(2, a - 2)
    q = f"{who} has {a} {item}. {he} gives {b} of them to {other}. How many {item} does {who} have left?"
    return _Problem(q, [(f"{who} has", f"{a} - {b}", a - b)], a - b)


def _mul(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    q = f"{who} buys {a} bags of {item}. Each bag has {b} {item}. How many {item} does {who} buy in total?"
    return _Problem(q, [(f"{who} buys", f"{a} * {b}", a * b)], a * b)


def _add_sub(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a, b = rng.randint(3, 15), rng.randint(2, 10)
    c = rng.randint(2, a + b - 1)
    q = f"{who} has {a} {item}. {he} buys {b} more and then gives {c} to {other}. How many {item} does {who} have now?"
    return _Problem(
        q, [(f"After buying, {who} has", f"{a} + {b}", a + b), ("Then", f"{a + b} - {c}", a + b - c)], a + b - c
    )


def _mul_add(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a, b, c = rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 12)
    q = f"{who} has {c} {item}. {he} buys {a} boxes with {b} {item} in each box. How many {item} does {who} have now?"
    steps = [("The boxes hold", f"{a} * {b}", a * b), (f"So {who} has", f"{c} + {a * b}", c + a * b)]
    return _Problem(q, steps, c + a * b)


def _sub_sub(rng: random.Random, who: str, he: str, other: str, item: str) -> _Problem:
    a = rng.randint(10, 30)
    b = rng.randint(2, a // 2)
    c = rng.randint(1, a - b - 1)
    q = f"{who} had {a} {item}. {he} lost {b} on Monday and {c} on Tuesday. How many {item} does {who} have left?"
    return _Problem(
        q, [("After Monday", f"{a} - {b}", a - b), ("After Tuesday", f"{a - b} - {c}", a - b - c)], a - b - c
    )


# Half one-step, half two-step templates (drawn uniformly).
_TEMPLATES: list[tuple[int, Callable[..., _Problem]]] = [
    (1, _add), (1, _sub), (1, _mul), (2, _add_sub), (2, _mul_add), (2, _sub_sub),
]  # fmt: skip


def heldout_point(question: str) -> float:
    """Uniform number in [0, 1) from sha256 of the question; below :data:`HELDOUT_SHARE` means held-out."""
    digest = hashlib.sha256(f"gsm8k_synth\x00{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def make_gsm8k_synth(split: Split, *, num_rows: int, seed: int, chat: bool = True) -> list[dict[str, Any]]:
    """``num_rows`` distinct problems of ``split`` in verl's layout, deterministic in ``seed``.

    Args:
        split: ``"train"`` or ``"test"`` (held-out); disjoint for any seeds.
        num_rows: Number of rows, 1..:data:`MAX_ROWS`.
        seed: Seed of the problem generator (``random.Random``; global RNGs are untouched).
        chat: If True, ``prompt`` is one user message; if False, the plain text.

    Returns:
        Rows ``{"prompt", "data_source", "ability", "reward_model": {"style", "ground_truth"}, "extra_info"}``.

    Raises:
        ValueError: on another ``split`` or ``num_rows`` outside 1..:data:`MAX_ROWS`.
    """
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k_synth: split={split!r} must be 'train' or 'test'")
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"num_rows={num_rows} must be in 1..{MAX_ROWS} (data.toy_rows / prepare-data --limit).")
    rng = random.Random(f"gsm8k_synth-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < num_rows:
        if misses > 100_000:  # an invariant (~20% of draws are held-out); fail loudly rather than spin
            raise RuntimeError(f"gsm8k_synth: {misses} draws in a row gave no new {split} problem")
        (who, he), (other, _) = rng.sample(_PEOPLE, 2)
        num_ops, template = rng.choice(_TEMPLATES)
        problem = template(rng, who, he, other, rng.choice(_ITEMS))
        if problem.question in seen or (heldout_point(problem.question) < HELDOUT_SHARE) != (split == "test"):
            misses += 1
            continue
        misses = 0
        seen.add(problem.question)
        text = f"{problem.question}\n{INSTRUCTION}"
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}] if chat else text,
                "data_source": GSM8K_SYNTH_SOURCE,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "question": problem.question,
                    "answer": problem.solution,
                    "num_ops": num_ops,
                },
            }
        )
    return rows
