"""The critic role's math: values and the clipped value-loss update."""

from __future__ import annotations

from workers.critic.dp_critic import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
