"""The sampling settings of one generation call, passed by the controller to the rollout role as a typed value.

The controller builds them from ``rollout.*`` (training) or ``rollout.val_kwargs`` (validation); the engines
(``workers.rollout``) take them as they are. Plain Python values only, so they travel through Ray unchanged.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SamplingParams"]


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
