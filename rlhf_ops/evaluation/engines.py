"""The rollout engine evaluation decodes with, injected: the library never imports ``workers/``.

Evaluation uses the same rollout engine as training (``workers.rollout.hf_rollout.HFRollout``). The
library only knows the one rollout interface (:class:`rlhf_ops.extensions.RolloutEngine`, which training
uses too) and the factory Protocol below; the engine itself is passed in by the caller
(``evaluate_model(..., engine_factory=...)``) or, when the caller passes none (the ``rlhf eval`` command,
the pipeline's evaluate task), found by name in the ``rlhf_ops.rollout_engines`` entry-point group that
``pyproject.toml`` registers (``hf = "workers.rollout.hf_rollout:HFRollout"``). See ``docs/decisions.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

from rlhf_ops.extensions.rollout import RolloutEngine

ENGINE_GROUP = "rlhf_ops.rollout_engines"


class EngineFactory(Protocol):
    """Builds an engine on a loaded HF causal LM with fixed sampling settings (``HFRollout`` is one)."""

    def __call__(
        self,
        module: Any,
        *,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        response_length: int,
        temperature: float,
        top_p: float,
        top_k: int,
        do_sample: bool,
        seed: int,
        sync_stop: bool | None,
    ) -> RolloutEngine: ...


def load_engine_factory(name: str) -> EngineFactory:
    """The engine factory registered as ``name`` in the ``rlhf_ops.rollout_engines`` entry-point group.

    Raises:
        ValueError: nothing is registered under ``name`` (the installed metadata predates the entry point).
    """
    found = list(entry_points(group=ENGINE_GROUP, name=name))
    if not found:
        known = sorted(ep.name for ep in entry_points(group=ENGINE_GROUP))
        raise ValueError(
            f"no rollout engine {name!r} in the entry-point group {ENGINE_GROUP} (registered: {known}); "
            "reinstall the project (pip install -e .) so its entry points are registered"
        )
    factory: EngineFactory = found[0].load()
    return factory
