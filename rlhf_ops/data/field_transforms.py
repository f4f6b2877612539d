"""Named value transforms in ``field_map``: raw dataset columns become prompts and ground truths as verl makes them.

A ``field_map`` value is a source column (or dotted path), optionally followed by transforms, each after a
``|``, applied left to right::

    field_map:
      prompt: "question|template:{} Let's think step by step and output the final answer after \\"####\\"."
      ground_truth: "answer|gsm8k_final_answer"        # GSM8K: "... #### 1,234" -> "1234"
    # MATH:   ground_truth: "solution|math_last_boxed"  # "... \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"

``template:`` takes the rest of the string as its text (it may hold ``|`` and ``:``), so it comes last; ``{}``
in it is the value. An extraction that finds nothing (a GSM8K answer without ``#### N``, a solution without a
complete ``\\boxed{}``) raises :class:`NoAnswer`: the row goes to ``rejected.jsonl`` with the reason.
The extractors follow verl's preprocessing scripts (``examples/data_preprocess/gsm8k.py``, ``math_dataset.py``);
the reward functions (:mod:`rlhf_ops.rewards`) import this package, so they are not reused here (an import cycle)
and a test scores prepared ground truths with the ``gsm8k`` and ``math`` rewards instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TEMPLATE = "template"
PLACEHOLDER = "{}"
Row = dict[str, Any]
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's gsm8k.py preprocessing pattern
_BOX_PREFIXES = ("\\boxed", "\\fbox")
# verl's GSM8K preprocessing instruction (examples/data_preprocess/gsm8k.py), for a ready-made template.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class NoAnswer(ValueError):
    """A transform found nothing to extract in this row's value (the row is rejected, the run goes on)."""


def gsm8k_final_answer(value: str, arg: str | None) -> str:
    """The number after GSM8K's ``####``, commas removed (verl's preprocessing ``extract_solution``)."""
    found = _GSM8K_ANSWER.search(value)
    answer = found.group(1).replace(",", "").rstrip(".") if found else ""
    if not any(c.isdigit() for c in answer):
        raise NoAnswer("has no '#### <number>' final answer")
    return answer


def math_last_boxed(value: str, arg: str | None) -> str:
    """The content of the last complete ``\\boxed{...}`` (braces balanced), as verl's MATH preprocessing."""
    start = max(value.rfind(prefix) for prefix in _BOX_PREFIXES)
    if start >= 0:
        rest = value[start:].removeprefix("\\boxed").removeprefix("\\fbox")
        if rest.startswith(" "):  # "\boxed 5$": the answer runs to the next "$"
            return rest[1:].split("$")[0].strip()
        depth = 0
        for i, char in enumerate(rest if rest.startswith("{") else ""):  # "\boxed x": no braces, no answer
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                return rest[1:i]
    raise NoAnswer("has no complete \\boxed{...} answer")


def template(value: str, arg: str | None) -> str:
    """``arg`` with ``{}`` replaced by the value (``str.replace``: the text may hold other braces)."""
    assert arg is not None  # parse_field_source checks that a template has its text
    return arg.replace(PLACEHOLDER, value)


def strip(value: str, arg: str | None) -> str:
    """The value without leading and trailing whitespace."""
    return value.strip()


@dataclass(frozen=True)
class Transform:
    """One named transform: the function, whether it takes ``:<arg>``, and a line for the docs."""

    fn: Callable[[str, str | None], str]
    takes_arg: bool
    summary: str


TRANSFORMS: dict[str, Transform] = {
    "gsm8k_final_answer": Transform(gsm8k_final_answer, False, "GSM8K answer after '####', commas removed"),
    "math_last_boxed": Transform(math_last_boxed, False, "content of the last \\boxed{...} (MATH solutions)"),
    TEMPLATE: Transform(template, True, "'template:<text with {}>' puts the value into a text (the last step)"),
    "strip": Transform(strip, False, "remove surrounding whitespace"),
}


@dataclass(frozen=True)
class FieldSource:
    """A parsed ``field_map`` value: the source column (or dotted path) and the transforms applied to it."""

    column: str
    steps: tuple[tuple[str, str | None], ...] = ()

    def apply(self, value: str) -> str:
        """The value through every step; :class:`NoAnswer` when an extractor finds nothing."""
        for name, arg in self.steps:
            value = TRANSFORMS[name].fn(value, arg)
        return value


def _names() -> str:
    return ", ".join(f"{name}:<text with {{}}>" if t.takes_arg else name for name, t in TRANSFORMS.items())


def parse_field_source(field: str, text: str) -> FieldSource:
    """``"answer|gsm8k_final_answer"`` -> ``FieldSource("answer", (("gsm8k_final_answer", None),))``.

    Raises:
        ValueError: one line naming ``field_map.<field>`` and the fix (unknown transform, a template without
            ``{}``, an argument where none is taken, an empty column).
    """
    where = f"field_map.{field}={text!r}"
    column, _, rest = text.partition("|")
    column = column.strip()
    if not column:
        raise ValueError(f"{where}: no source column before the transforms; write 'column|transform'")
    steps: list[tuple[str, str | None]] = []
    while rest:
        step, _, after = rest.partition("|")
        name, sep, arg = step.partition(":")
        name = name.strip()
        if name == TEMPLATE:  # the template's text runs to the end of the string
            arg, after = rest.partition(":")[2], ""
            if not sep or PLACEHOLDER not in arg:
                raise ValueError(f"{where}: template needs a text with '{{}}' for the value, e.g. 'template:Q: {{}}'")
        elif name not in TRANSFORMS:
            raise ValueError(f"{where}: unknown transform {name!r}; use one of {_names()}")
        elif sep:
            raise ValueError(f"{where}: transform {name!r} takes no ':' argument; write '|{name}'")
        steps.append((name, arg if name == TEMPLATE else None))
        rest = after
    return FieldSource(column, tuple(steps))


def transform_row_value(source: FieldSource, field: str, value: Any, *, missing: bool) -> Any:
    """``value`` (a row's ``source.column``) through ``source``'s transforms; the row is rejected when it lacks
    the column, holds no text there, or an extractor finds no answer. Without transforms ``value`` is returned."""
    if not source.steps:
        return value
    from rlhf_ops.data.sources import Reject  # pyarrow and the stores: not at import (the trigger form parses maps)

    if missing:
        raise Reject("missing_field", f"{field}: the row has no {source.column!r} (field_map.{field})")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        kind = type(value).__name__
        raise Reject("wrong_type", f"{field}: {source.column!r} is {kind}; field_map transforms take text")
    try:
        return source.apply(str(value))
    except NoAnswer as exc:
        raise Reject("no_answer", f"{field}: {source.column!r} {exc}") from None


def absent_column_problem(sources: Mapping[str, FieldSource], present: set[str], example: Row | None) -> str | None:
    """One line when a transformed field's column is in no row of the source (a wrong ``field_map``), else None."""
    for field, source in sources.items():
        if source.steps and source.column not in present and example is not None:
            return (
                f"field_map.{field}: column {source.column!r} is in no row of the source; map {field} to one of "
                f"the source's columns {sorted(example)} (e.g. field_map.{field}='<column>|...')"
            )
    return None
