"""The trigger form's default override allow-list names only keys the config has (no dead keys)."""

from __future__ import annotations

import fnmatch
import types
import typing
from collections.abc import Iterator

import pytest
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


def test_the_specs_code_ships_and_the_form_ships_only_what_allowed_code_allows() -> None:
    from rlhf_ops.pipeline.override_policy import OverridePolicy

    policy = OverridePolicy.from_dict(
        {
            "code": {"py_modules": ["/opt/team/rewards"], "pip": ["math-verify==0.9.0"]},
            "allowed_code": {"py_modules": ["s3://team-code/*"]},
            "spec": "dags/specs/team.yaml",
        }
    )
    assert OverridePolicy.from_dict(None).shipped_code(None).runtime_env() == {}  # nothing by default
    code = policy.shipped_code({"py_modules": ["s3://team-code/extra_rewards.zip"]})
    assert code.runtime_env() == {
        "py_modules": ["/opt/team/rewards", "s3://team-code/extra_rewards.zip"],
        "pip": ["math-verify==0.9.0"],
    }
    assert code.module_names() == ["rewards", "extra_rewards"]
    with pytest.raises(ValueError) as refused:
        policy.shipped_code({"pip": ["evil==1.0"], "working_dir": "/home/me"})
    assert str(refused.value) == (
        "code.working_dir: '/home/me' may not be shipped from this pipeline's trigger form. Fix: remove it, or have "
        "the platform team allow it under allowed_code.working_dir in dags/specs/team.yaml; code.pip: 'evil==1.0' may "
        "not be shipped from this pipeline's trigger form. Fix: remove it, or have the platform team allow it under "
        "allowed_code.pip in dags/specs/team.yaml"
    )
    with pytest.raises(ValueError, match=r"^code.py_module: Extra inputs are not permitted; valid keys: working_dir"):
        policy.shipped_code({"py_module": ["x"]})
    with pytest.raises(ValueError, match=r"allowed_code has unknown key\(s\) \['pips'\]"):
        OverridePolicy.from_dict({"allowed_code": {"pips": ["*"]}})


def test_verl_names_are_judged_by_the_key_they_set() -> None:
    from rlhf_ops.pipeline.override_policy import OverridePolicy

    policy = OverridePolicy()
    allowed = ["actor_rollout_ref.actor.optim.lr=1e-6", "data.max_response_length=64", "actor_rollout_ref.rollout.n=8"]
    assert policy.problems(allowed) == []
    # verl's names cannot reach what the form may not set: the reward function, the device, the cluster size.
    refused = ["custom_reward_function.path=/tmp/evil.py", "trainer.device=cuda", "trainer.n_gpus_per_node=64"]
    assert [p.message.split("'")[1] for p in policy.problems(refused)] == [o.partition("=")[0] for o in refused]
