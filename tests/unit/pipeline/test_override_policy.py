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


def test_verl_names_are_judged_by_the_key_they_set() -> None:
    from rlhf_ops.pipeline.override_policy import OverridePolicy

    policy = OverridePolicy()
    allowed = ["actor_rollout_ref.actor.optim.lr=1e-6", "data.max_response_length=64", "actor_rollout_ref.rollout.n=8"]
    assert policy.problems(allowed) == []
    # verl's names cannot reach what the form may not set: the reward function, the device, the cluster size.
    refused = ["custom_reward_function.path=/tmp/evil.py", "trainer.device=cuda", "trainer.n_gpus_per_node=64"]
    assert [p.message.split("'")[1] for p in policy.problems(refused)] == [o.partition("=")[0] for o in refused]
