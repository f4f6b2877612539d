"""The rollout engine contract shared by the HF engine and the vLLM engine.

Notation: B = prompts in the request, n = samples per prompt, P = prompt length (left-padded),
R = ``response_length`` (responses are always padded to exactly R columns, as in verl), T = P + R.

``generate_sequences`` input (a :class:`~rlhf_ops.protocol.DataProto`):
    tensors ``input_ids`` (B, P) left-padded, ``attention_mask`` (B, P), ``position_ids`` (B, P);
    any non-tensor columns (carried to the output, repeated n times); ``meta_info`` keys read by
    :meth:`SamplingParams.from_meta`: ``n``, ``temperature``, ``top_p``, ``top_k``, ``do_sample``,
    ``response_length`` (max new tokens), ``eos_token_id``, ``pad_token_id``.

Output (B * n rows; the n samples of a prompt are adjacent, like ``DataProto.repeat(n, interleave=True)``):
    ``prompts`` (B*n, P), ``responses`` (B*n, R) right-padded with ``pad_token_id`` after the first EOS,
    ``input_ids`` / ``attention_mask`` / ``position_ids`` (B*n, T) from
    :func:`rlhf_ops.padding.build_full_sequence`, ``response_mask`` (B*n, R) (1 up to and including the
    first EOS), ``rollout_log_probs`` (B*n, R) float32, 0 on masked tokens; ``meta_info["timing"]``.

``rollout_log_probs`` are, by default (``logprobs_mode="raw"``), log-probs of the sampled tokens under the
raw model distribution at temperature 1: ``log_softmax(logits)``, before temperature, top-k and top-p.
That is vLLM's default (``logprobs_mode="raw_logprobs"``) and equals the actor's recomputed
``old_log_probs`` when the actor uses temperature 1. ``"processed"`` records ``log_softmax`` of the
logits actually sampled from (divided by temperature, top-k / top-p filtered to -inf), vLLM's
``processed_logprobs``: the exact behaviour-policy log-prob for importance-sampling corrections.
Note the actor recomputes ``log_softmax(logits / temperature)`` without filtering, which equals neither
mode when temperature != 1 and top-k / top-p are on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from torch import Tensor

from rlhf_ops.protocol import DataProto

LogprobsMode = Literal["raw", "processed"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one ``generate_sequences`` call."""

    n: int = 1
    """Samples per prompt (the output has B * n rows). Pass 1 if the caller already repeated the batch."""
    temperature: float = 1.0
    """Divides the logits before sampling; 0 means greedy (vLLM's convention)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables it (vLLM uses -1, HF uses 0)."""
    do_sample: bool = True
    """False: greedy argmax of the raw logits (temperature, top-k and top-p ignored)."""
    response_length: int = 16
    """R: max new tokens; responses are padded to exactly R columns."""
    eos_token_id: int | tuple[int, ...] = 2
    """Id(s) that end a response; the first one is kept and masked in, later columns are padding."""
    pad_token_id: int = 0
    """Id written after the first EOS (and its mask is 0)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (samples per prompt).")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling.")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or -1 / 0 to disable it.")
        if self.response_length < 1:
            raise ValueError(f"response_length={self.response_length} must be >= 1 (max new tokens).")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (``do_sample=False`` or ``temperature == 0``)."""
        return not self.do_sample or self.temperature == 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple."""
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], defaults: SamplingParams) -> SamplingParams:
        """Returns ``defaults`` overridden by the sampling keys present in ``meta`` (a ``meta_info``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        overrides: dict[str, Any] = {k: v for k, v in meta.items() if k in names}
        if isinstance(overrides.get("eos_token_id"), Sequence):
            overrides["eos_token_id"] = tuple(overrides["eos_token_id"])
        return dataclasses.replace(defaults, **overrides)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of prompts; the HF engine and the vLLM engine implement it."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Samples responses; see the module docstring for the input and output keys and shapes."""
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
