"""The actor role's math: log-probs and the PPO policy update (also used by the reference policy)."""

from __future__ import annotations

from workers.actor.dp_actor import DataParallelPPOActor
from workers.actor.forward import response_log_probs, supports_logits_to_keep

__all__ = ["DataParallelPPOActor", "response_log_probs", "supports_logits_to_keep"]
