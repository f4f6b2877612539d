"""The trigger form's default override allow-list names only keys the config has (no dead keys)."""

from __future__ import annotations

import fnmatch
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel

from rlhf_ops.config.schema import RunConfig
from rlhf_ops.pipeline.override_policy import DEFAULT_ALLOWED_OVERRIDES


def _sections(annotation: object) -> list[type[BaseModel]]:
    """The config sections an annotation holds (``X``, ``X | None``, ``list[X]``...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType or origin in (list, tuple, dict, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _sections(arg)]
    return []


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        yield key
        for section in _sections(field.annotation):
            yield from _dotted_keys(section, f"{key}.")


def test_every_default_allowed_override_names_a_config_key() -> None:
    keys = set(_dotted_keys(RunConfig))
    assert "actor.optim.lr" in keys and "reward.overlong_buffer.len" in keys  # the walk reaches nested sections
    dead = [p for p in DEFAULT_ALLOWED_OVERRIDES if not fnmatch.filter(keys, p)]
    assert dead == [], f"allowed overrides that match no config key: {dead}"
