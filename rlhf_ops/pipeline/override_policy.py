"""Which config keys the trigger form's free-form ``overrides`` may set.

Whoever can trigger a DAG can type ``overrides``; without a limit that person can run the model folder's own
code (``model.trust_remote_code=true``), import any function (``reward.reward_fn``), point the job at another
cluster (``resources.ray_address``) or send its metrics elsewhere (``tracking.mlflow_uri``). A pipeline
therefore allows only the training knobs of :data:`DEFAULT_ALLOWED_OVERRIDES`; its YAML spec
(``dags/specs/*.yaml``) may add keys with ``allowed_overrides: [pattern, ...]`` (``fnmatch`` patterns over
dotted keys, ``*`` = every key). The overrides written in the spec itself are the operator's and always pass.
Keys the pipeline owns (the checkpoint folder, run name, data files, logger, resume mode) are set after the
user's overrides anyway (:func:`rlhf_ops.pipeline.params.run_overrides`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
)
SPEC_FIELD = "allowed_overrides"


@dataclass(frozen=True)
class OverridePolicy:
    """``allowed``: patterns of keys the form may set; ``trusted``: the spec's own override strings."""

    allowed: tuple[str, ...] = DEFAULT_ALLOWED_OVERRIDES
    trusted: tuple[str, ...] = ()
    spec: str = field(default="the DAG's spec (dags/specs/<name>.yaml)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> OverridePolicy:
        """The policy a DAG passes to its ``preflight`` task (``extra_allowed`` adds to the default set)."""
        data = dict(data or {})
        extra = tuple(str(p) for p in data.get("extra_allowed") or ())
        trusted = tuple(str(o) for o in data.get("trusted") or ())
        spec = str(data.get("spec") or cls.spec)
        return cls(allowed=(*DEFAULT_ALLOWED_OVERRIDES, *extra), trusted=trusted, spec=spec)

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
