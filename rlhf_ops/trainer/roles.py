"""What the controller needs from each role: explicit, typed interfaces (Protocols).

The Ray-backed implementations live in ``workers/`` (one facade per worker group); the controller
never sees Ray, ranks or dispatch modes.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlhf_ops.protocol import DataProto


class ActorRolloutRef(Protocol):
    """The colocated actor / rollout / reference group."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Samples responses (and ``old_log_probs`` with ``meta_info['recompute_log_prob']``)."""
        ...

    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` (B, R): the actor's log-probs of the responses before the update."""
        ...

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R) under the reference policy."""
        ...

    def update_actor(self, data: DataProto) -> dict[str, float]:
        """One PPO update over the batch; returns reduced ``actor/*`` metrics."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


class Critic(Protocol):
    """The value model group (GAE only)."""

    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R)."""
        ...

    def update_critic(self, data: DataProto) -> dict[str, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


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
