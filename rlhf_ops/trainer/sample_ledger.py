"""Per-sample accounting: which prompts each optimizer step trained on, carried through checkpoints.

Every prompt row of a batch has a sample id (its ``uid``: ``e<epoch>-<row>``; a group of ``rollout.n`` responses
shares its prompt's). :meth:`SampleLedger.record` is called once per optimizer step with the ids the update
consumed, whatever produced them (a synchronous step, the one-step-off prefetch, an asynchronous pipeline), and
returns the step's figures for the metrics log:

- ``samples/step_count``: distinct sample ids this step trained on;
- ``samples/consumed_total``: the run's total so far;
- ``samples/consumed_digest``: an order-independent digest of every id consumed so far (a sum of 48-bit hashes
  modulo 2**52, exact as a float): a dropped or duplicated sample changes it.

The totals are part of the trainer's checkpoint state, so a resumed run continues them: its
``samples/consumed_*`` at every step equal an uninterrupted run's exactly when it neither dropped nor repeated a
sample (``tests/reliability/test_faults_recovery.py`` and the one-step-off resume test compare them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

_MODULUS = 2**52  # below float64's 2**53: the digest survives the metrics log's floats exactly


def sample_hash(sample_id: str) -> int:
    """A stable 48-bit hash of one sample id (not Python's ``hash``: that changes per process)."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=6).digest(), "big")


class SampleLedger:
    """Running count and digest of the sample ids the run's optimizer steps consumed."""

    def __init__(self) -> None:
        self.count = 0
        self.digest = 0

    def record(self, sample_ids: Iterable[Any]) -> dict[str, float]:
        """Account for one optimizer step's samples; returns the step's ``samples/*`` metrics."""
        distinct = list(dict.fromkeys(str(s) for s in sample_ids))
        self.count += len(distinct)
        self.digest = (self.digest + sum(sample_hash(s) for s in distinct)) % _MODULUS
        return {
            "samples/step_count": float(len(distinct)),
            "samples/consumed_total": float(self.count),
            "samples/consumed_digest": float(self.digest),
        }

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count, "digest": self.digest}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        """Restore the totals (a checkpoint from before the ledger has none: counting restarts at 0)."""
        state = state or {}
        self.count, self.digest = int(state.get("count", 0)), int(state.get("digest", 0))
