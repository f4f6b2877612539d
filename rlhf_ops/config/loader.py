"""Loading a :class:`RunConfig`: a YAML preset (shipped name or file), then dotted overrides.

``load_config("tiny-cpu", ["algorithm.kl_ctrl.kl_coef=0.02", "rollout.n=8"])``: values of overrides
are parsed as YAML scalars/lists (``true``, ``1e-6``, ``[a, b]``); ``key=null`` sets None. verl's key names
(``actor_rollout_ref.actor.optim.lr``) are accepted in both and stored under ours
(:mod:`rlhf_ops.config.verl_compat`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf_ops.config.errors import ConfigError, ConfigProblem, from_validation_error, one_line, shown_value
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.config.validate import check_config
from rlhf_ops.config.verl_compat import translate_mapping, translate_or_raise

PRESET_PACKAGE = "rlhf_ops.config.presets"


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def read_preset(preset: str | Path) -> dict[str, Any]:
    """The raw mapping of a shipped preset name or a YAML file path."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    else:
        name = str(preset)
        candidate = resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml")
        if not candidate.is_file():
            raise ConfigError(
                [ConfigProblem("preset", f"unknown preset {name!r}", f"use one of {list_presets()} or a YAML path")]
            )
        text = candidate.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("preset", f"{preset} is not a mapping", "write key: value pairs")])
    return translate_mapping(data)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` -> (["a", "b"], 1)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            [ConfigProblem(shown_value(item), "override is not of the form dotted.key=value", "write key=value")]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        reason = one_line(str(exc))[:200]
        problem = ConfigProblem(key, f"value {shown_value(raw)} is not valid YAML ({reason})", "quote it")
        raise ConfigError([problem]) from None
    return key.split("."), value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str], *, verl_names: bool = True) -> dict[str, Any]:
    """A copy of ``data`` with every override applied (creating intermediate mappings).

    ``verl_names``: verl's keys are translated to ours first (all refused ones raised at once).
    """
    out = copy.deepcopy(dict(data))
    pairs = [(".".join(path), value) for path, value in map(parse_override, overrides)]
    if verl_names:
        pairs = translate_or_raise(pairs)
    for item, value in pairs:
        path = item.split(".")
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                dotted = ".".join(path[: i + 1])
                raise ConfigError([ConfigProblem(dotted, f"is a value, not a section (in {item!r})", "fix the key")])
            node = child
        node[path[-1]] = value
    return out


def build_config(data: Mapping[str, Any]) -> RunConfig:
    """Validates a raw mapping: field errors first, then cross-field rules; all problems at once."""
    try:
        run = RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise from_validation_error(exc, RunConfig) from None
    return check_config(run)


def load_config(preset: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The resolved, validated config of ``preset`` with ``overrides`` applied."""
    return build_config(apply_overrides(read_preset(preset), overrides))


def dump_config(run: RunConfig) -> str:
    """YAML of the resolved config; ``load_config`` of this text gives an equal config."""
    return yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False)
