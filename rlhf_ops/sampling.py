"""The sampling settings of one generation call, passed by the controller to the rollout role as a typed value.

The controller builds them from ``rollout.*`` (training) or ``rollout.val_kwargs`` (validation); the engines
(``workers.rollout``) take them as they are. Plain Python values only, so they travel through Ray unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["SamplingParams", "rollout_logprobs_comparable", "rollout_logprobs_mode"]


def rollout_logprobs_mode(*, temperature: float, top_p: float, top_k: int) -> Literal["raw", "processed"]:
    """What the engines' ``rollout_log_probs`` hold for a run sampling with these settings.

    ``"processed"`` (log-probs of the temperature-scaled distribution the tokens were drawn from) when nothing
    truncates it (``top_p == 1``, ``top_k`` off): they then equal the actor's recompute at the rollout
    temperature, which is what ``training/rollout_probs_diff_*`` and truncated importance sampling compare
    against. With top-p / top-k the sampled distribution is one the actor cannot recompute, so ``"raw"``
    (temperature 1, unfiltered: comparable at temperature 1 only).
    """
    del temperature  # processed == raw at temperature 1; the choice depends on truncation only
    return "processed" if top_p >= 1.0 and top_k <= 0 else "raw"


def rollout_logprobs_comparable(*, temperature: float, top_p: float, top_k: int) -> bool:
    """True when the engines' ``rollout_log_probs`` equal the actor's log-probs at ``temperature`` (see above)."""
    mode = rollout_logprobs_mode(temperature=temperature, top_p=top_p, top_k=top_k)
    return mode == "processed" or temperature == 1.0


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
