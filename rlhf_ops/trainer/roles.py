"""What the controller needs from each role: explicit, typed interfaces (Protocols).

The Ray-backed implementations live in ``workers/`` (one facade per worker group); the controller
never sees Ray, ranks or dispatch modes. Control values (sampling settings, temperature, step) are
arguments, never ``meta_info`` entries; ``meta_info`` carries only what a worker reports back
(``timing``, ``metrics``). Each call returns the keys it computes, nothing of its input.

Notation: B = sequences, R = response length.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams


class ActorRolloutRef(Protocol):
    """The colocated actor / rollout / reference group."""

    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams, *, step: int | None) -> DataProto:
        """Samples ``sampling.n`` responses per prompt (see ``workers.rollout.base`` for the keys).

        ``step`` seeds the engines' sampling (None: their running generator): a resumed run samples
        exactly what an uninterrupted one did.
        """
        ...

    def compute_log_prob(self, data: DataProto, *, temperature: float, step: int | None) -> DataProto:
        """``old_log_probs`` (B, R): the actor's log-probs of the responses (logits / ``temperature``)."""
        ...

    def compute_ref_log_prob(self, data: DataProto, *, temperature: float, step: int | None) -> DataProto:
        """``ref_log_prob`` (B, R) under the reference policy."""
        ...

    def update_actor(self, data: DataProto, *, temperature: float, step: int | None) -> dict[str, float]:
        """One PPO update over the batch; returns ``actor/*`` metrics. ``step`` seeds the mini-batch
        shuffle (None: the actor's count of updates)."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> list[RankUpload]:
        """Without a shared filesystem: each rank's shards written on its node and uploaded; one entry per rank."""
        ...

    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None: ...


class Critic(Protocol):
    """The value model group (GAE only)."""

    def compute_values(self, data: DataProto, *, step: int | None) -> DataProto:
        """``values`` (B, R)."""
        ...

    def update_critic(self, data: DataProto, *, step: int | None) -> dict[str, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> list[RankUpload]:
        """Without a shared filesystem: each rank's shards written on its node and uploaded; one entry per rank."""
        ...

    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None: ...


class RewardModel(Protocol):
    """A sequence-classification reward model group."""

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, R): the score at the last valid response token."""
        ...


class Tokenizer(Protocol):
    """The tokenizer parts the controller uses (a Hugging Face tokenizer whose pad token is set)."""

    @property
    def pad_token_id(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...


class Resumable(Protocol):
    """What a checkpointer saves and restores of the controller (step, loader position, RNG, KL state)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer(Protocol):
    """Saves, resumes and finishes the run's checkpoints (``rlhf_ops.checkpoint.manager.CheckpointManager``)."""

    def maybe_resume(self, trainer: Resumable) -> int | None:
        """Restores the newest complete checkpoint into ``trainer``; its step, or None when starting fresh."""
        ...

    def save(self, trainer: Resumable) -> object: ...

    def finish(self) -> None:
        """Waits for uploads and applies retention."""
        ...
