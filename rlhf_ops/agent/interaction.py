"""Interactions: an environment that answers the model between turns (a user, a grader, a game).

After a model turn without tool calls the agent loop asks the interaction for a reply: a string is
rendered as a ``user`` message (observation tokens, mask 0) and the model gets another turn; ``None``
ends the episode. Config names one by dotted path (``rollout.multi_turn.interaction``).
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

from rlhf_ops.agent.tools import SampleState


@runtime_checkable
class Interaction(Protocol):
    """Answers a finished model turn, or ends the episode."""

    def respond(self, model_text: str, state: SampleState) -> str | None:
        """The environment's reply to ``model_text`` (the model's last turn, special tokens skipped), or
        None to end the episode. ``state.row`` holds the sample's columns (``ground_truth``...)."""
        ...


_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


class AnswerFeedback:
    """Grader for ``#### N`` answers (GSM8K format): says whether the model's answer is right.

    Wrong or missing answer: replies "That is not correct..." (the model may try again, up to ``max_turns``);
    right: ends the episode. ``max_replies`` bounds its replies per sample.
    """

    def __init__(self, max_replies: int = 1) -> None:
        self.max_replies = max_replies

    def respond(self, model_text: str, state: SampleState) -> str | None:
        """Feedback text, or None when the answer matches ``state.row['ground_truth']`` or replies ran out."""
        truth = str(state.row.get("ground_truth", "")).replace(",", "").strip()
        found = _ANSWER.findall(model_text)
        answer: Any = found[-1].replace(",", "") if found else None
        if answer is not None and _same_number(answer, truth):
            return None
        if state.interaction_turns >= self.max_replies:
            return None
        if answer is None:
            return "I could not find a final answer. End your reply with '#### <number>'."
        return "That is not correct. Check your calculation and answer again, ending with '#### <number>'."


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b
