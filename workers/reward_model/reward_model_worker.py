"""``RewardModelWorker``: a sequence-classification reward model (FSDP2, no optimizer).

Notation: B = sequences, T = full length (prompt + response), R = response length.
The model must share the policy's tokenizer (the scores are computed on the policy's token ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_ops.config.precision import resolve_precision
from rlhf_ops.config.schema import DType, FSDPConfig
from rlhf_ops.protocol import DataProto
from workers.fsdp.mesh import build_device_mesh, get_device
from workers.fsdp.wrap import build_fsdp_model
from workers.single_controller.decorator import Dispatch, register
from workers.single_controller.worker import RankContext, Worker


@dataclass(frozen=True, kw_only=True)
class RewardModelSpec:
    model_path: str
    micro_batch_size: int
    dtype: DType
    attn_implementation: str
    fsdp: FSDPConfig
    device: str


def place_at_last_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) sequence scores -> (B, R) token scores, each on its row's last valid response token."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)
    out[torch.arange(out.shape[0], device=out.device), last] = scores.float()
    return out


class RewardModelWorker(Worker):
    """One rank of the reward-model group."""

    def __init__(self, ctx: RankContext, *, spec: RewardModelSpec) -> None:
        super().__init__(ctx)
        self.spec = spec

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.device = get_device(self.spec.device)
        mesh = build_device_mesh(self.world_size, device_type=self.device.type)
        self.module = build_fsdp_model(
            self.spec.model_path,
            kind="sequence_classification",
            mesh=mesh,
            cfg=self.spec.fsdp,
            device=self.device,
            precision=resolve_precision(
                self.spec.dtype, self.spec.fsdp, trained=False, device=self.device.type, role="reward"
            ),
            attn_implementation=self.spec.attn_implementation,
        )
        self.module.eval()
        dist.barrier()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, R): the model's score of the full sequence at the last response token.

        HF sequence classifiers pool at the last non-pad token, found from ``pad_token_id``; with
        right-padded responses that is the last valid response token.
        """
        batch = data.batch
        assert batch is not None
        scores = []
        with torch.no_grad():
            for start in range(0, len(data), self.spec.micro_batch_size):
                sl = slice(start, start + self.spec.micro_batch_size)
                out = self.module(
                    input_ids=batch["input_ids"][sl].to(self.device),
                    attention_mask=batch["attention_mask"][sl].to(self.device),
                    position_ids=batch["position_ids"][sl].to(self.device),
                )
                scores.append(out.logits[:, 0].float().cpu())
        token_scores = place_at_last_token(torch.cat(scores), batch["response_mask"])
        return DataProto.from_dict({"rm_scores": token_scores})
