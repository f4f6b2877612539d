"""Built-in toy tasks for tests, demos and the learning test.

Rows are plain dicts ``{"prompt": str | list[message], "ground_truth": str, "data_source": str}``, the
shape ``rlhf prepare-data`` reads from JSONL / Parquet. Every character used fits the tiny tokenizer's
alphabet (:mod:`rlhf_ops.models.tiny`). Scoring lives in :mod:`rlhf_ops.rewards.toy`, keyed by
``data_source``.

Tasks:
    ``copy_digit`` (``data_source="toy/copy_digit"``): prompt ``"copy: 7"`` → answer ``"7"``. The
        reward depends on the prompt's digit, so the policy must read the prompt. From the random-init
        tiny model, GRPO (16 prompts x n=8, lr 1e-2) lifts the mean shaped score from ~0.04 to ~0.15 in
        30 steps on one CPU core (``tests/unit/rollout/test_toy_learnability.py``); most of that is
        "answer with a digit", the right digit rises above chance more slowly.
    ``add_digits`` (``data_source="toy/add_digits"``): prompt ``"2+5="`` → answer ``"7"`` (a, b in 0..9,
        so answers have one or two digits). Exact answers suit accuracy and pass@k evaluation.
    ``color_name`` (``data_source="toy/color_name"``, vision-language): a 16 x 16 solid-colour PNG in the
        row's ``images`` and the prompt ``"<image>colour?"`` → the colour word (``red``, ``green``, ``blue``,
        ``yellow``; :mod:`rlhf_ops.data.images`). Only the image tells the colours apart.
    ``gsm8k_synth`` / ``gsm8k_synth_test`` (``data_source="synth/gsm8k"``): word problems in GSM8K's
        format for real (pretrained) models, train and held-out splits; rows in verl's layout, see
        :mod:`rlhf_ops.data.gsm8k_synth` (not in :data:`TOY_TASKS`: they need a real tokenizer).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rlhf_ops.data.gsm8k_synth import GSM8K_SYNTH_SOURCE, Split, make_gsm8k_synth

__all__ = ["ADD_DIGITS_SOURCE", "COPY_DIGIT_SOURCE", "GSM8K_SYNTH_SOURCE", "TOY_TASKS", "make_toy_dataset"]

COPY_DIGIT_SOURCE = "toy/copy_digit"
ADD_DIGITS_SOURCE = "toy/add_digits"


def _copy_digit_row(rng: random.Random) -> tuple[str, str, str]:
    digit = str(rng.randrange(10))
    return f"copy: {digit}", digit, COPY_DIGIT_SOURCE


def _add_digits_row(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str(a + b), ADD_DIGITS_SOURCE


# name -> row generator returning (prompt text, ground truth, data source)
TOY_TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "copy_digit": _copy_digit_row,
    "add_digits": _add_digits_row,
}
# builtin name -> split of the GSM8K-format generator (rows in verl's layout)
GSM8K_SYNTH_SPLITS: dict[str, Split] = {"gsm8k_synth": "train", "gsm8k_synth_test": "test"}
BUILTIN_TASKS = (*TOY_TASKS, "color_name", *GSM8K_SYNTH_SPLITS)  # color_name: IMAGE_TOY_TASKS


def _image_tasks() -> dict[str, Callable[[random.Random], tuple[str, str, str, list[bytes]]]]:
    from rlhf_ops.data.images import color_name_row  # PIL only for the image task

    return {"color_name": color_name_row}


IMAGE_TOY_TASKS = ("color_name",)


def make_toy_dataset(name: str, *, num_rows: int, seed: int, chat: bool = True) -> list[dict[str, Any]]:
    """Returns ``num_rows`` rows of toy task ``name``, deterministic in ``seed``.

    Args:
        name: A key of :data:`TOY_TASKS` (``"copy_digit"`` or ``"add_digits"``) or of
            :data:`IMAGE_TOY_TASKS` (``"color_name"``, whose rows also hold ``images``: [PNG bytes]) or of
            :data:`GSM8K_SYNTH_SPLITS` (``"gsm8k_synth"``, ``"gsm8k_synth_test"``).
        num_rows: Number of rows (>= 1).
        seed: Seed of the row generator (``random.Random``; global RNGs are untouched).
        chat: If True, ``prompt`` is ``[{"role": "user", "content": text}]`` (for the chat template, as
            verl datasets store it); if False, the plain text.

    Returns:
        Rows ``{"prompt", "ground_truth", "data_source"}`` (+ ``"images"`` for an image task; GSM8K tasks:
        verl's layout, see :func:`rlhf_ops.data.gsm8k_synth.make_gsm8k_synth`).

    Raises:
        ValueError: on an unknown ``name`` or ``num_rows < 1``.
    """
    if name in GSM8K_SYNTH_SPLITS:
        return make_gsm8k_synth(GSM8K_SYNTH_SPLITS[name], num_rows=num_rows, seed=seed, chat=chat)
    if name not in TOY_TASKS and name not in IMAGE_TOY_TASKS:
        raise ValueError(f"Unknown builtin task name={name!r}; choose one of {sorted(BUILTIN_TASKS)}.")
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows} must be >= 1.")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    image_task = _image_tasks()[name] if name in IMAGE_TOY_TASKS else None
    for _ in range(num_rows):
        images: list[bytes] | None = None
        if image_task is not None:
            text, truth, source, images = image_task(rng)
        else:
            text, truth, source = TOY_TASKS[name](rng)
        prompt: str | list[dict[str, str]] = [{"role": "user", "content": text}] if chat else text
        rows.append({"prompt": prompt, "ground_truth": truth, "data_source": source})
        if images is not None:
            rows[-1]["images"] = images
    return rows
