"""A throw-away worker role, outside the package, registered in the role table as a user's package would.

One module is the whole role: its spec, its worker (registered dispatch methods), its builder and its client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_ops.protocol import DataProto
from workers.roles import RoleContext, WorkerRole
from workers.single_controller.decorator import Dispatch, register
from workers.single_controller.worker import RankContext, Worker


@dataclass(frozen=True, kw_only=True)
class LengthSpec:
    """The role's own settings: what a response token is worth."""

    scale: float


class ResponseLengthWorker(Worker):
    """One rank: scores each response by its length times ``scale``, and says which rank scored it."""

    def __init__(self, ctx: RankContext, *, spec: LengthSpec) -> None:
        super().__init__(ctx)
        self.spec = spec
        self.ready = False

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.ready = True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score_lengths(self, data: DataProto) -> DataProto:
        """``length_scores`` (B,) = response tokens * scale; ``scored_by`` (B,) the rank."""
        assert self.ready and data.batch is not None
        lengths = data.batch["response_mask"].sum(-1).float() * self.spec.scale
        ranks = torch.full_like(lengths, float(self.rank))
        return DataProto.from_dict({"length_scores": lengths, "scored_by": ranks})


class ResponseLengthClient:
    """The controller's side: one group call."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def score_lengths(self, data: DataProto) -> DataProto:
        out: DataProto = self.group.call(ResponseLengthWorker.score_lengths, data)
        return out


def build_length_role(config: Any, plan: Any, ctx: RoleContext) -> tuple[type, Any] | None:
    """Started when the run's ``algorithm.gamma`` is set (always, in the test); the scale is that gamma."""
    return ResponseLengthWorker, LengthSpec(scale=float(config.algorithm.gamma))


ROLE = WorkerRole(
    name="length_scorer",
    target=build_length_role,
    client=ResponseLengthClient,
    methods=("init_model", "score_lengths"),
    description="A test's throw-away role: response length times algorithm.gamma.",
)
