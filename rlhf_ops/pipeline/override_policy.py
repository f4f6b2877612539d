"""Which config keys the trigger form's free-form ``overrides`` may set.

Whoever can trigger a DAG can type ``overrides``; without a limit that person can run the model folder's own
code (``model.trust_remote_code=true``), import any function (``reward.reward_fn``), point the job at another
cluster (``resources.ray_address``) or send its metrics elsewhere (``tracking.mlflow_uri``). A pipeline
therefore allows only the training knobs of :data:`DEFAULT_ALLOWED_OVERRIDES`; its YAML spec
(``dags/specs/*.yaml``) may add keys with ``allowed_overrides: [pattern, ...]`` (``fnmatch`` patterns over
dotted keys, ``*`` = every key). The overrides written in the spec itself are the operator's and always pass.
Keys the pipeline owns (the checkpoint folder, run name, data files, logger, resume mode) are set after the
user's overrides anyway (:func:`rlhf_ops.pipeline.params.run_overrides`).

Shipping code with a run (Ray ``runtime_env``: ``working_dir``, ``py_modules``, ``pip``) follows the same rule: the
spec's own ``code`` is the operator's and always ships; the form's ``code`` parameter may ship only what the spec's
``allowed_code`` patterns allow (``{"py_modules": ["s3://team-code/*"], "pip": ["my-rewards==*"]}``; nothing by
default), since shipped code runs on the cluster with the cluster's identity.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlhf_ops.config import ConfigError, ConfigProblem
from rlhf_ops.config.loader import parse_override
from rlhf_ops.config.verl_compat import translate

DEFAULT_ALLOWED_OVERRIDES: tuple[str, ...] = (
    "algorithm.*",
    "actor.*",
    "critic.optim.*",
    "critic.ppo_*",
    "critic.grad_clip",
    "critic.cliprange_value",
    "critic.use_dynamic_bsz",
    "critic.use_remove_padding",
    "critic.fsdp.*",
    "ref.*",
    "rollout.*",
    "data.train_batch_size",
    "data.val_batch_size",
    "data.max_prompt_length",
    "data.shuffle",
    "data.apply_chat_template",
    "reward.overlong_buffer.*",
    "reward.micro_batch_size_per_gpu",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.seed",
    "trainer.balance_batch",
    "trainer.save_hf_model",
    "trainer.early_stop.*",
)
SPEC_FIELD = "allowed_overrides"
CODE_FIELD = "allowed_code"


class ShippedCode(BaseModel):
    """Code shipped with a run, as Ray ``runtime_env`` fields: local paths (uploaded by the submitting client)
    or URIs the cluster can fetch (``s3://bucket/code.zip``, ``https://...``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    working_dir: str | None = None
    """A folder (or zip URI) that becomes the job's working directory, importable from it."""
    py_modules: list[str] = Field(default_factory=list)
    """Packages or modules (folders, ``.py`` files, zip or wheel URIs) put on every worker's ``sys.path``."""
    pip: list[str] = Field(default_factory=list)
    """Requirement strings Ray installs into the job's own virtualenv."""

    @classmethod
    def parse(cls, data: Mapping[str, Any] | None, *, field_name: str) -> ShippedCode:
        """``data`` as shipped code; one line naming ``field_name`` and the key on a bad value."""
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(
                f"{field_name}.{where}: {first['msg']}; valid keys: working_dir (str), py_modules (list), pip (list)"
            ) from None

    def module_names(self) -> list[str]:
        """Top-level module names of ``py_modules`` (a folder or ``x.py`` / ``x.zip``: ``x``; wheels are skipped)."""
        names = []
        for entry in self.py_modules:
            name = PurePosixPath(urlsplit(entry).path if "://" in entry else entry).name
            if name.endswith(".whl") or not name:
                continue
            names.append(name.removesuffix(".py").removesuffix(".zip"))
        return names

    def runtime_env(self) -> dict[str, Any]:
        """The Ray ``runtime_env`` fields (only the set ones)."""
        env: dict[str, Any] = {}
        if self.working_dir:
            env["working_dir"] = self.working_dir
        if self.py_modules:
            env["py_modules"] = list(self.py_modules)
        if self.pip:
            env["pip"] = list(self.pip)
        return env


@dataclass(frozen=True)
class OverridePolicy:
    """``allowed``: patterns of keys the form may set; ``trusted``: the spec's own override strings."""

    allowed: tuple[str, ...] = DEFAULT_ALLOWED_OVERRIDES
    trusted: tuple[str, ...] = ()
    spec: str = field(default="the DAG's spec (dags/specs/<name>.yaml)")
    code: ShippedCode = field(default_factory=ShippedCode)
    """The spec's own shipped code (trusted)."""
    allowed_code: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per ``ShippedCode`` field, the patterns of what the form's ``code`` may ship."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> OverridePolicy:
        """The policy a DAG passes to its ``preflight`` task (``extra_allowed`` adds to the default set)."""
        data = dict(data or {})
        extra = tuple(str(p) for p in data.get("extra_allowed") or ())
        trusted = tuple(str(o) for o in data.get("trusted") or ())
        spec = str(data.get("spec") or cls.spec)
        code = ShippedCode.parse(data.get("code"), field_name="code")
        allowed_code = {str(k): tuple(str(p) for p in v or ()) for k, v in dict(data.get(CODE_FIELD) or {}).items()}
        unknown = sorted(set(allowed_code) - set(ShippedCode.model_fields))
        if unknown:
            raise ValueError(f"{CODE_FIELD} has unknown key(s) {unknown}; valid: {sorted(ShippedCode.model_fields)}")
        extra_allowed = (*DEFAULT_ALLOWED_OVERRIDES, *extra)
        return cls(allowed=extra_allowed, trusted=trusted, spec=spec, code=code, allowed_code=allowed_code)

    def allows(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.allowed)

    def problems(self, overrides: Iterable[str]) -> list[ConfigProblem]:
        """One problem per override whose key the form may not set (key = ``overrides``, the form field)."""
        out = []
        for item in overrides:
            if item in self.trusted:
                continue
            key = item.partition("=")[0].strip()
            if not all(self.allows(native) for native in _native_keys(item)):
                out.append(
                    ConfigProblem(
                        "overrides",
                        f"{key!r} may not be set from this pipeline's trigger form",
                        f"remove it, or have the platform team add {key!r} to {SPEC_FIELD} in {self.spec}",
                    )
                )
        return out

    def code_problems(self, form_code: ShippedCode) -> list[ConfigProblem]:
        """One problem per entry of the form's ``code`` that ``allowed_code`` does not allow."""
        entries = [("working_dir", form_code.working_dir)] if form_code.working_dir else []
        entries += [("py_modules", m) for m in form_code.py_modules] + [("pip", r) for r in form_code.pip]
        out = []
        for key, value in entries:
            if not any(fnmatch.fnmatchcase(value, p) for p in self.allowed_code.get(key, ())):
                out.append(
                    ConfigProblem(
                        f"code.{key}",
                        f"{value!r} may not be shipped from this pipeline's trigger form",
                        f"remove it, or have the platform team allow it under {CODE_FIELD}.{key} in {self.spec}",
                    )
                )
        return out

    def shipped_code(self, form_code: Mapping[str, Any] | None) -> ShippedCode:
        """The run's code: the spec's, plus what the form adds (its ``working_dir`` replaces the spec's).

        Raises:
            ValueError: one line per refused entry or bad key of the form's ``code``.
        """
        extra = ShippedCode.parse(form_code, field_name="code")
        problems = self.code_problems(extra)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
        return ShippedCode(
            working_dir=extra.working_dir or self.code.working_dir,
            py_modules=[*self.code.py_modules, *extra.py_modules],
            pip=[*self.code.pip, *extra.pip],
        )


def _native_keys(item: str) -> list[str]:
    """The keys here an override sets: verl's names translated (``actor_rollout_ref.actor.optim.lr`` is
    ``actor.optim.lr``), so the policy judges what is set, whatever it is called; unreadable: the key as typed."""
    try:
        path, value = parse_override(item)
    except ConfigError:
        return [item.partition("=")[0].strip()]
    key = ".".join(path)
    translation = translate([(key, value)])
    return [native for native, _ in translation.pairs] or [key.lstrip("+")]
