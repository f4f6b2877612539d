"""Rollout engines: the ``RolloutEngine`` protocol and the HF engine (the vLLM engine follows the same protocol)."""

from workers.rollout.base import RolloutEngine, SamplingParams
from workers.rollout.hf_rollout import HFRollout

__all__ = ["HFRollout", "RolloutEngine", "SamplingParams"]
