"""verl's key names accepted in overrides and YAML: translated to the keys here, or refused in one line.

``actor_rollout_ref.actor.optim.lr=1e-6`` becomes ``actor.optim.lr=1e-6``; ``trainer.n_gpus_per_node=8``
becomes ``resources.nproc_per_node=8``; ``actor_rollout_ref.actor.strategy=megatron`` is refused with the
reason and the closest key here. The table is :data:`rlhf_ops.config.verl_keys.VERL_KEYS`. A key that is
already a key here is left alone (``data.train_batch_size``), unless the table converts its verl value
(``trainer.save_freq=-1``). The config is always stored and shown under the names here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from rlhf_ops.config.errors import ConfigError, ConfigProblem, one_line, shown_value
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.config.verl_keys import SKIP, VERL_KEYS, VERL_ONLY_ROOTS, Carry, Drop, Entry

REWARD_PATH, REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"
VERL_DEFAULT_REWARD_NAME = "compute_score"
DOCS = "docs/verl_migration.md"


@dataclass
class Translation:
    """The native ``(key, value)`` pairs, the verl keys dropped with no effect, and the refused ones."""

    pairs: list[tuple[str, Any]] = field(default_factory=list)
    carried: list[tuple[str, str]] = field(default_factory=list)  # (verl key, native key) renamed
    inert: list[tuple[str, Any, str]] = field(default_factory=list)  # (verl key, value, why it changes nothing)
    problems: list[ConfigProblem] = field(default_factory=list)


def lookup(key: str) -> Entry | None:
    """The table's entry of ``key``: exact, else the longest ``prefix.*`` that covers it."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        entry = VERL_KEYS.get(".".join(parts[:end]) + ".*")
        if entry is not None:
            return entry
    return None


def native_field(key: str) -> FieldInfo | None:
    """The schema field of a dotted key here (None when it is not one; a key inside a dict field counts)."""
    model: type[BaseModel] | None = RunConfig
    info: FieldInfo | None = None
    for part in key.split("."):
        if model is None:
            return info  # below a non-model field (a dict): its keys are its own
        info = model.model_fields.get(part)
        if info is None:
            return None
        model = _section(info)
    return info


def _section(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _same(a: Any, b: Any) -> bool:
    """Equal values of compatible types (``True`` is not ``1``; ``0`` is ``0.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _unset(value: Any) -> bool:
    """verl's unset value or a Hydra interpolation (it only follows another key)."""
    return value is None or (isinstance(value, str) and value.strip().startswith("${"))


def _refusal(key: str, value: Any, why: str, native: str | None) -> ConfigProblem:
    closest = f" (the closest setting here: {native})" if native else ""
    return ConfigProblem(
        key,
        f"this verl setting (= {shown_value(value)}) has no counterpart here: {why}",
        f"remove it{closest}; see {DOCS}",
    )


def _check_native(verl_key: str, native: str, value: Any) -> ConfigProblem | None:
    """The value against the native field's type and bounds, so the problem names the verl key."""
    info = native_field(native)
    if info is None:
        return None
    try:
        kind: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        message = one_line(str(exc.errors()[0]["msg"])).rstrip(".")
        return ConfigProblem(verl_key, f"{message} (got {shown_value(value)})", f"set a value {native} accepts")
    return None


def _close(key: str, cutoff: float = 0.9) -> str | None:
    close = difflib.get_close_matches(key, [k for k in VERL_KEYS if not k.endswith("*")], n=1, cutoff=cutoff)
    return close[0] if close else None


def _unknown(key: str, close: str | None = None) -> ConfigProblem:
    close = close or _close(key, cutoff=0.6)
    hint = f"did you mean {close}? " if close else ""
    return ConfigProblem(
        key, "is not a verl key with a counterpart here", f"{hint}remove it; the verl keys accepted are in {DOCS}"
    )


def _translate_one(key: str, value: Any, out: Translation) -> None:
    entry = VERL_KEYS.get(key)
    if entry is None and native_field(key) is not None:
        out.pairs.append((key, value))
        return
    entry = entry or lookup(key)
    if entry is None:
        if key.split(".")[0] in VERL_ONLY_ROOTS:
            out.problems.append(_unknown(key))
        else:
            out.pairs.append((key, value))  # not verl's either: the schema names it and the keys near it
        return
    if key.endswith("._target_") or _unset(value):
        out.inert.append((key, value, "unset in verl: the default here applies"))
        return
    if isinstance(entry, Drop):
        if any(_same(value, inert) for inert in entry.inert):
            out.inert.append((key, value, entry.reason))
        elif key not in VERL_KEYS and (close := _close(key)):  # under a ".*" entry: a typo of a listed key?
            out.problems.append(_unknown(key, close))
        else:
            out.problems.append(_refusal(key, value, entry.reason, entry.native))
        return
    _carry(key, value, entry, out)


def _carry(key: str, value: Any, entry: Carry, out: Translation) -> None:
    if isinstance(value, str) and value in entry.refuse:
        out.problems.append(_refusal(key, value, entry.refuse[value], entry.natives[0]))
        return
    converted = entry.convert(value) if entry.convert else value
    if converted is SKIP:
        out.inert.append((key, value, "verl's 'not set': the default here applies"))
        return
    for native in entry.natives:  # a key of the same name here: the schema reports it with the others
        problem = None if native == key else _check_native(key, native, converted)
        if problem:
            out.problems.append(problem)
            return
    for native in entry.natives:
        out.pairs.append((native, converted))
        if native != key:
            out.carried.append((key, native))


def _reward_function(pairs: dict[str, Any], out: Translation) -> None:
    """verl's file + function name become one ``reward.reward_fn`` ('<module>:<function>')."""
    path, name = pairs.pop(REWARD_PATH, None), pairs.pop(REWARD_NAME, None)
    if _unset(path):
        if not _unset(name) and name != VERL_DEFAULT_REWARD_NAME:
            out.problems.append(
                ConfigProblem(REWARD_NAME, f"{shown_value(name)} names a function of no file", f"set {REWARD_PATH}")
            )
        return
    module = PurePath(str(path)).stem
    function = name if isinstance(name, str) and name else VERL_DEFAULT_REWARD_NAME
    out.pairs.append(("reward.reward_fn", f"{module}:{function}"))
    out.carried.append((REWARD_PATH, "reward.reward_fn"))


def translate(pairs: Iterable[tuple[str, Any]]) -> Translation:
    """verl keys among ``pairs`` (dotted key, value) to the keys here; native keys pass unchanged, in order."""
    items = [(key.lstrip("+"), value) for key, value in pairs if not key.startswith("~")]  # Hydra's +key / ~key
    rewards = {key: value for key, value in items if key in (REWARD_PATH, REWARD_NAME)}
    out = Translation()
    for key, value in items:
        if key not in (REWARD_PATH, REWARD_NAME):
            _translate_one(key, value, out)
    _reward_function(rewards, out)
    return out


def translate_or_raise(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """:func:`translate`, raising every refused key at once."""
    out = translate(pairs)
    if out.problems:
        raise ConfigError(out.problems)
    return out.pairs


def flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted ``(key, value)`` leaves of a YAML mapping; a native non-section field (a dict value) is one leaf."""
    leaves: list[tuple[str, Any]] = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        info = native_field(key)
        if isinstance(value, Mapping) and value and (info is None or _section(info) is not None):
            leaves += flatten(value, f"{key}.")
        else:
            leaves.append((key, value))
    return leaves


def nest(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The nested mapping of dotted ``(key, value)`` pairs (later pairs win)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            child = node.get(part)
            node[part] = child = child if isinstance(child, dict) else {}
            node = child
        node[last] = value
    return out


def translate_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    """A YAML mapping with verl's keys written under the names here (refused keys raise, all at once).

    Where a verl section (``actor_rollout_ref``...) and a key here set the same thing, the key here wins.
    """
    leaves = flatten(data)
    verl_first = sorted(leaves, key=lambda leaf: leaf[0].split(".")[0] not in VERL_ONLY_ROOTS)  # stable
    return nest(translate_or_raise(verl_first))
