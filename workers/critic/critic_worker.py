"""``CriticWorker``: one Ray actor per rank holding the FSDP2 value model and its optimizer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload
from rlhf_ops.config.batch_plan import PPOPlan, require_optimizer_steps
from rlhf_ops.config.precision import resolve_precision
from rlhf_ops.config.schema import AlgorithmConfig, CriticConfig, ModelConfig
from rlhf_ops.protocol import DataProto
from workers.checkpointing import fetch_role_dir, load_role_checkpoint, save_role_checkpoint, save_role_to_store
from workers.critic.dp_critic import DataParallelPPOCritic
from workers.fsdp.mesh import build_device_mesh, get_device, sp_process_groups
from workers.fsdp.optim import build_lr_scheduler, build_optimizer, optimizer_offload
from workers.fsdp.precision import flush_denormals
from workers.fsdp.wrap import build_fsdp_model
from workers.single_controller.decorator import Dispatch, register
from workers.single_controller.worker import RankContext, Worker
from workers.utils.perf import flops_model, mfu
from workers.utils.profiling import StageMonitor, monitored


@dataclass(frozen=True, kw_only=True)
class CriticSpec:
    """The critic's sections of the config, resolved by the driver."""

    model_path: str
    model: ModelConfig
    critic: CriticConfig
    algorithm: AlgorithmConfig
    plan: PPOPlan  # derived with steps_per_epoch: the LR schedule's length is plan.optimizer_steps
    seed: int
    device: str
    profile_steps: tuple[int, ...] = ()  # trainer.profile_steps
    profile_dir: str = ""  # absolute trainer.profile_dir


class CriticWorker(Worker):
    """One rank of the critic group (PPO with GAE)."""

    def __init__(self, ctx: RankContext, *, spec: CriticSpec) -> None:
        super().__init__(ctx)
        self.spec = spec
        self.critic: DataParallelPPOCritic | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        spec = self.spec
        torch.manual_seed(spec.seed)
        self.device = get_device(spec.device)
        flush_denormals(self.device)
        self.monitor = StageMonitor(
            role="critic",
            rank=self.rank,
            device=self.device,
            profile_steps=spec.profile_steps,
            profile_dir=spec.profile_dir,
        )
        # The plan's replicate size: from fsdp.fsdp_size (shard-group size) or fsdp.hsdp_replicate_size.
        mesh = build_device_mesh(
            self.world_size,
            replicate_size=spec.plan.mesh.replicate_size,
            device_type=self.device.type,
        )
        sp_size = spec.plan.mesh.sp_size  # Ulysses: FSDP shards over every rank; (dp, sp) groups split the work
        dp_group, sp_group = sp_process_groups(self.world_size, sp_size=sp_size, device_type=self.device.type)
        if sp_size > 1:
            self.set_sequence_parallel_size(sp_size)  # every rank of an SP group gets the same DP chunk
        module = build_fsdp_model(
            spec.model_path,
            kind="value",
            mesh=mesh,
            cfg=spec.critic.fsdp,
            device=self.device,
            precision=resolve_precision(
                spec.model.dtype, spec.critic.fsdp, trained=True, device=self.device.type, role="critic"
            ),
            attn_implementation=spec.model.attn_implementation,
            trust_remote_code=spec.model.trust_remote_code,
            use_liger=spec.model.use_liger,
        )
        optimizer = build_optimizer(module, spec.critic.optim)
        scheduler = build_lr_scheduler(optimizer, spec.critic.optim, require_optimizer_steps(spec.plan, role="critic"))
        self.critic = DataParallelPPOCritic(
            module,
            optimizer,
            scheduler,
            config=spec.critic,
            algorithm=spec.algorithm,
            plan=spec.plan,
            dp_group=dp_group,
            sp_group=sp_group,
            device=self.device,
            seed=spec.seed,
        )
        self.flops = flops_model(module)
        dist.barrier()

    def _critic(self) -> DataParallelPPOCritic:
        if self.critic is None:
            raise RuntimeError("critic: call init_model first")
        return self.critic

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("values")
    def compute_values(self, data: DataProto, step: int | None = None) -> DataProto:
        """``values`` (B, R); ``step`` only labels the call (profiling)."""
        values = self._critic().compute_values(data.to(self.device))
        return DataProto.from_dict({"values": values.cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("update_critic", report=True)
    def update_critic(self, data: DataProto, step: int | None = None) -> DataProto:
        """One value-function update; ``critic/*`` metrics in ``meta_info``; ``step`` labels the call."""
        critic = self._critic()
        start = time.perf_counter()
        # fsdp.optimizer_offload: Adam state on the host except from the first optimizer step to the update's end.
        with optimizer_offload(critic.optimizer, enabled=self.spec.critic.fsdp.optimizer_offload):
            metrics = critic.update_critic(data.to(self.device))
        seq_lens = data.batch["attention_mask"].sum(-1).tolist() * self.spec.plan.ppo_epochs  # type: ignore[index]
        flops = self.flops.train_flops(seq_lens) / self.spec.plan.mesh.sp_size  # SP ranks share the sequences
        metrics["perf/mfu/critic"] = mfu(flops=flops, seconds=time.perf_counter() - start, device=self.device)
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        critic = self._critic()
        save_role_checkpoint(path, critic.module, critic.optimizer, critic.lr_scheduler)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        critic = self._critic()
        load_role_checkpoint(path, critic.module, critic.optimizer, critic.lr_scheduler)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> RankUpload:
        """Without a shared filesystem: this rank's shards on its node, uploaded to ``ckpt.remote_url``."""
        critic = self._critic()
        return save_role_to_store(ckpt, role, critic.module, critic.optimizer, critic.lr_scheduler)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None:
        """Without a shared filesystem: loads the node's copy of ``ckpt.remote_url`` (downloaded once per node)."""
        self.load_checkpoint(fetch_role_dir(ckpt, role))
