"""``RewardModelWorker``: a sequence-classification reward model (FSDP2, no optimizer).

Notation: B = sequences, T = full length (prompt + response), R = response length.
The model must share the policy's tokenizer (the scores are computed on the policy's token ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf_ops.config.batch_plan import MeshPlan
from rlhf_ops.config.precision import resolve_precision
from rlhf_ops.config.schema import DType, FSDPConfig
from rlhf_ops.padding import last_valid_index
from rlhf_ops.protocol import DataProto
from workers.fsdp.mesh import build_device_mesh, get_device
from workers.fsdp.precision import flush_denormals
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
    mesh: MeshPlan  # the plan's reward_model: reward.fsdp.fsdp_size / hsdp_replicate_size
    device: str


def place_at_last_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) sequence scores -> (B, R) token scores, each on its row's last valid response token."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    last = last_valid_index(response_mask)  # the model's last token, also when the mask has holes
    out[torch.arange(out.shape[0], device=out.device), last] = scores.float()
    return out


def score_at_last_attended_token(
    module: nn.Module, *, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
) -> Tensor:
    """(B,) reward-model scores read at each row's last attended token (verl pools by the mask, too).

    HF sequence classifiers pool at the last token that is not ``pad_token_id``; when pad == eos (SmolLM2,
    Qwen2.5) that skips the response's real EOS, so the model would score the answer without its ending.
    The per-token scores of the ``score`` head (B, T, 1) are captured with a forward hook and read at the
    last column whose ``attention_mask`` is 1. Models without a ``score`` head keep HF's pooled logits.

    Args:
        module: An HF ``*ForSequenceClassification`` model with ``num_labels=1`` (FSDP2-wrapped or plain).
        input_ids: (B, T); attention_mask: (B, T) 1 on real tokens; position_ids: (B, T).
    """
    head = getattr(module, "score", None)
    captured: list[Tensor] = []
    handle = head.register_forward_hook(lambda _m, _i, out: captured.append(out)) if head is not None else None
    try:
        pooled = module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    finally:
        if handle is not None:
            handle.remove()
    if not captured:
        return pooled[:, 0].float()
    per_token = captured[-1][..., 0].float()  # (B, T)
    last = attention_mask.long().cumsum(-1).argmax(-1)  # first column reaching the row's token count: its last 1
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), last]


class RewardModelWorker(Worker):
    """One rank of the reward-model group."""

    def __init__(self, ctx: RankContext, *, spec: RewardModelSpec) -> None:
        super().__init__(ctx)
        self.spec = spec

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.device = get_device(self.spec.device)
        flush_denormals(self.device)
        assert self.spec.mesh.world_size == self.world_size, (self.spec.mesh, self.world_size)
        # 1-D ("fsdp",) or, with reward.fsdp.fsdp_size / hsdp_replicate_size, 2-D ("replicate", "shard").
        mesh = build_device_mesh(
            self.world_size, replicate_size=self.spec.mesh.replicate_size, device_type=self.device.type
        )
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

        Read at each row's last attended token (:func:`score_at_last_attended_token`): the response's
        EOS is scored even when it equals ``pad_token_id``.
        """
        batch = data.batch
        assert batch is not None
        scores = []
        with torch.no_grad():
            for start in range(0, len(data), self.spec.micro_batch_size):
                sl = slice(start, start + self.spec.micro_batch_size)
                scores.append(
                    score_at_last_attended_token(
                        self.module,
                        input_ids=batch["input_ids"][sl].to(self.device),
                        attention_mask=batch["attention_mask"][sl].to(self.device),
                        position_ids=batch["position_ids"][sl].to(self.device),
                    ).cpu()
                )
        token_scores = place_at_last_token(torch.cat(scores), batch["response_mask"])
        return DataProto.from_dict({"rm_scores": token_scores})
