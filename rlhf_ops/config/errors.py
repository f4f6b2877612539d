"""Readable configuration errors: one line per problem, naming the dotted key and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError


@dataclass(frozen=True)
class ConfigProblem:
    """One problem: ``key`` is the dotted path (``actor.ppo_mini_batch_size``), ``fix`` what to set."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """Raised with every problem found, not only the first."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


SHOWN_VALUE_LIMIT = 120  # characters of a refused value quoted in its message (a 100k-character value stays one line)


def shown_value(value: Any) -> str:
    """``repr(value)``, cut to ``SHOWN_VALUE_LIMIT`` characters: always one line, whatever the value holds."""
    text = repr(value)
    return f"{text[:SHOWN_VALUE_LIMIT]}... ({len(text)} chars)" if len(text) > SHOWN_VALUE_LIMIT else text


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into spaces (library messages, e.g. YAML's, span lines)."""
    return " ".join(text.split())


def _dotted(loc: Iterable[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of ``loc`` (for key suggestions)."""
    current: type[BaseModel] = model
    for part in loc[:-1]:
        field = current.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        current = annotation
    return current


def _fix_for(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    kind, ctx, loc = error["type"], error.get("ctx") or {}, error["loc"]
    if "fix" in ctx:  # our own validators (PydanticCustomError) carry their fix
        return str(ctx["fix"])
    if kind == "extra_forbidden":
        owner = _model_at(root, loc)
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean '{_dotted([*loc[:-1], close[0]])}'? " if close else ""
        return f"{hint}remove it; valid keys here: {', '.join(valid)}"
    if kind == "missing":
        return "set it (it has no default)"
    if kind == "literal_error":
        return f"set one of {ctx.get('expected', '')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()), "")
        return f"set a value {op} {bound}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"set a value of type {kind.removesuffix('_parsing').removesuffix('_type')}"
    if kind == "too_short":
        return "set a non-empty value"
    return "see the configuration reference in the README"


def from_validation_error(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """Turns pydantic's error into a :class:`ConfigError` with one line per problem."""
    problems = []
    for error in exc.errors():
        loc = list(error["loc"])
        value = error.get("input")
        shown = "" if error["type"] in ("missing",) or isinstance(value, dict) else f" (got {shown_value(value)})"
        message = one_line(error["msg"]).rstrip(".") + shown
        problems.append(ConfigProblem(_dotted(loc), message, _fix_for(error, root)))
    return ConfigError(problems)
