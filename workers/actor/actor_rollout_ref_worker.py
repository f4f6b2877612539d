"""``ActorRolloutRefWorker``: one Ray actor per rank holding the actor, the rollout engine and the
reference policy, in any combination (``actor``, ``rollout``, ``ref``, ``actor_rollout``,
``actor_rollout_ref``).

The roles are a set parsed once from the role name; each method checks the part it needs and fails
with the role name if it is missing (no boolean flags branching through the class).

The rollout engine is the ``rollout.engine`` entry of the engine table: its sync builder, or with
``rollout.mode=async`` its async one (vLLM's ``AsyncLLM``, engine core in its own process; design and the
vLLM findings: ``docs/async_rollout.md``). Such an engine can also generate in the background while the ranks
train (``trainer.pipeline=one_step_off``): :meth:`ActorRolloutRefWorker.submit_sequences` and
:meth:`ActorRolloutRefWorker.collect_sequences`, through a :class:`~workers.rollout.prefetch.RolloutPrefetch`.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload
from rlhf_ops.config.batch_plan import BatchPlan, require_optimizer_steps
from rlhf_ops.config.lora_rules import resolve_lora_sync
from rlhf_ops.config.precision import resolve_precision
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, RefConfig, RolloutConfig
from rlhf_ops.extensions import ROLLOUT_ENGINES, RolloutEngineSpec
from rlhf_ops.models.modality import media_token_ids
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams, rollout_logprobs_comparable, rollout_logprobs_mode
from workers.actor.dp_actor import DataParallelPPOActor
from workers.checkpointing import (
    fetch_role_dir,
    gather_full_state_dict,
    load_role_checkpoint,
    save_role_checkpoint,
    save_role_to_store,
)
from workers.fsdp.lora import adapters_disabled
from workers.fsdp.mesh import build_device_mesh, get_device, sp_process_groups
from workers.fsdp.optim import build_lr_scheduler, build_optimizer, optimizer_offload
from workers.fsdp.precision import flush_denormals
from workers.fsdp.wrap import build_fsdp_model
from workers.rollout.base import EngineContext, RolloutEngine
from workers.rollout.multi_turn import maybe_multi_turn
from workers.rollout.prefetch import RolloutPrefetch
from workers.rollout.sharding_manager import FSDPShardingManager
from workers.single_controller.decorator import Dispatch, register
from workers.single_controller.worker import RankContext, Worker
from workers.utils.perf import flops_model, memory_metrics, mfu
from workers.utils.profiling import StageMonitor, monitored

Role = Literal["actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref"]
ROLE_PARTS: dict[str, frozenset[str]] = {
    "actor": frozenset({"actor"}),
    "rollout": frozenset({"rollout"}),
    "ref": frozenset({"ref"}),
    "actor_rollout": frozenset({"actor", "rollout"}),
    "actor_rollout_ref": frozenset({"actor", "rollout", "ref"}),
}


@dataclass(frozen=True, kw_only=True)
class ActorRolloutRefSpec:
    """Everything a rank needs, resolved by the driver (sections of the config, never the root)."""

    role: Role
    model_path: str
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    plan: BatchPlan  # derived with steps_per_epoch: the LR schedule's length is plan.actor.optimizer_steps
    pad_token_id: int
    eos_token_id: int | tuple[int, ...]  # every id that ends a response (rlhf_ops.models.generation)
    seed: int
    device: str
    num_threads: int = 1
    """Intra-op threads (``resources.threads_per_worker``); set before the vLLM engine disables set_num_threads."""
    profile_steps: tuple[int, ...] = ()  # trainer.profile_steps
    profile_dir: str = ""  # absolute trainer.profile_dir
    live_metrics: bool = False  # trainer.logger has prometheus: the rollout's measurements go to Ray's metrics


class ActorRolloutRefWorker(Worker):
    """One rank of the actor / rollout / reference group."""

    def __init__(self, ctx: RankContext, *, spec: ActorRolloutRefSpec) -> None:
        super().__init__(ctx)
        if spec.role not in ROLE_PARTS:
            raise ValueError(f"role={spec.role!r}: choose one of {sorted(ROLE_PARTS)}")
        self.spec, self.parts = spec, ROLE_PARTS[spec.role]
        self.actor: DataParallelPPOActor | None = None
        self.ref: DataParallelPPOActor | None = None
        self.rollout: RolloutEngine | None = None
        self._ref_is_actor_base = False  # LoRA: the reference is the actor's module with adapters disabled
        self.sharding_manager: FSDPShardingManager | None = None
        self.live: Any = None  # workers.live_metrics.RolloutMetrics, made at the first rollout (spec.live_metrics)
        self.prefetch = RolloutPrefetch()  # trainer.pipeline=one_step_off: the rollout generating beside training

    def _need(self, part: str, method: str) -> None:
        if part not in self.parts:
            raise RuntimeError(f"{method} needs the '{part}' part, but this worker's role is '{self.spec.role}'")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Builds the FSDP2 models (meta-device init, weights broadcast from rank 0), optimizer, engine."""
        spec = self.spec
        self.device = get_device(spec.device)
        flush_denormals(self.device)  # before the OpenMP pool starts: its threads inherit the flags
        # First: building a vLLM CPU engine replaces torch.set_num_threads with a no-op for the process.
        torch.set_num_threads(spec.num_threads)
        torch.manual_seed(spec.seed)
        self.monitor = StageMonitor(
            role="actor",
            rank=self.rank,
            device=self.device,
            profile_steps=spec.profile_steps,
            profile_dir=spec.profile_dir,
        )
        # The plan's replicate size: from fsdp.fsdp_size (shard-group size) or fsdp.hsdp_replicate_size.
        self.mesh = build_device_mesh(
            self.world_size,
            replicate_size=spec.plan.actor.mesh.replicate_size,
            device_type=self.device.type,
        )
        # Ulysses: FSDP still shards over every rank; the (dp, sp) groups split the batch and the sequences.
        sp_size = spec.plan.actor.mesh.sp_size
        self.dp_group, self.sp_group = sp_process_groups(
            self.world_size, sp_size=sp_size, device_type=self.device.type
        )
        if sp_size > 1:
            self.set_sequence_parallel_size(sp_size)  # every rank of an SP group gets the same DP chunk
        common: dict[str, Any] = {
            "mesh": self.mesh,
            "device": self.device,
            "attn_implementation": spec.model.attn_implementation,
            "trust_remote_code": spec.model.trust_remote_code,
            "use_liger": spec.model.use_liger,
        }
        # LoRA: the actor is base + adapters; the reference policy is that module with adapters disabled.
        lora = spec.model.lora if "actor" in self.parts and spec.model.lora.rank > 0 else None
        if self.parts & {"actor", "rollout"}:
            # fp32 master weights and optimizer state; model.dtype is the compute dtype (rlhf_ops.config.precision).
            precision = resolve_precision(
                spec.model.dtype, spec.actor.fsdp, trained="actor" in self.parts, device=self.device.type
            )
            module = build_fsdp_model(
                spec.model_path, kind="causal_lm", cfg=spec.actor.fsdp, lora=lora, precision=precision, **common
            )
            optimizer = scheduler = None
            if "actor" in self.parts:
                optimizer = build_optimizer(module, spec.actor.optim)
                scheduler = build_lr_scheduler(optimizer, spec.actor.optim, self._optimizer_steps())
            self.actor = DataParallelPPOActor(
                module,
                optimizer,
                scheduler,
                config=spec.actor,
                algorithm=spec.algorithm,
                plan=spec.plan.actor,
                dp_group=self.dp_group,
                sp_group=self.sp_group,
                device=self.device,
                seed=spec.seed,
                rollout_logprobs_at_temperature=rollout_logprobs_comparable(
                    temperature=spec.rollout.temperature, top_p=spec.rollout.top_p, top_k=spec.rollout.top_k
                ),
            )
            self.flops = flops_model(module)  # MFU from the architecture (LoRA: frozen base, trained adapters)
        if "rollout" in self.parts:
            self.rollout = self._build_rollout()
        if "ref" in self.parts:
            self.ref = self._build_ref(common, share_actor=lora is not None)
        dist.barrier()

    def _build_ref(self, common: dict[str, Any], *, share_actor: bool) -> DataParallelPPOActor:
        """The reference policy: a second FSDP2 model, or (LoRA) the actor's module itself, no weight copy."""
        spec = self.spec
        self._ref_is_actor_base = share_actor
        if share_actor:
            assert self.actor is not None
            ref_module = self.actor.module  # forwards under adapters_disabled (see _reference_forward)
        else:
            # No optimizer: on GPU stored in the compute dtype (bf16), on CPU fp32 under the actor's autocast.
            precision = resolve_precision(
                spec.model.dtype, spec.ref.fsdp, trained=False, device=self.device.type, role="ref"
            )
            ref_module = build_fsdp_model(
                spec.model_path, kind="causal_lm", cfg=spec.ref.fsdp, precision=precision, **common
            )
            ref_module.eval()
        return DataParallelPPOActor(
            ref_module,
            config=spec.actor,
            algorithm=spec.algorithm,
            plan=spec.plan.actor,
            dp_group=self.dp_group,
            sp_group=self.sp_group,
            device=self.device,
        )

    @contextmanager
    def _reference_forward(self) -> Iterator[None]:
        """Shared LoRA module: eval mode (no adapter dropout) with adapters disabled, restored after."""
        if not self._ref_is_actor_base:
            yield
            return
        assert self.ref is not None
        module = self.ref.module
        was_training = module.training
        module.eval()
        try:
            with adapters_disabled(module):
                yield
        finally:
            module.train(was_training)

    def _optimizer_steps(self) -> int:
        return require_optimizer_steps(self.spec.plan.actor, role="actor")

    def _build_rollout(self) -> RolloutEngine:
        """The ``rollout.engine`` entry of the engine table, built from one :class:`EngineContext`.

        An engine that holds its own copy of the weights (``weight_sync``) gets the sharding manager: it gathers
        the FSDP shards bucket by bucket into the engine before each generation that follows an update (and
        frees the KV cache after, on GPU), cast to the engine's dtype at the gather (fp32 masters into a bf16
        engine move half the bytes). A LoRA policy goes as its adapter alone where ``rollout.lora_sync``
        resolves to ``adapter`` (the engine serves it on its own base weights; ``auto``: on GPU), else merged.
        The agent loop wraps either when multi-turn is on.
        """
        spec, r = self.spec, self.spec.rollout
        assert self.actor is not None
        entry = ROLLOUT_ENGINES.get(r.engine)
        device: Literal["cpu", "cuda"] = "cuda" if self.device.type == "cuda" else "cpu"
        lora_sync = resolve_lora_sync(spec.model.lora, r, device) if entry.weight_sync else "merged"
        context = EngineContext(
            model_path=spec.model_path,
            config=r,
            pad_token_id=spec.pad_token_id,
            eos_token_id=spec.eos_token_id,
            seed=spec.seed + 1000 * self.rank,
            device=device,
            max_prompt_length=spec.plan.max_prompt_length,
            logprobs_mode=rollout_logprobs_mode(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
            module=self.actor.module,
            suppress_token_ids=media_token_ids(getattr(self.actor.module, "config", None)),  # a VLM: <image>
            lora_rank=spec.model.lora.rank if lora_sync == "adapter" else 0,
        )
        engine = self._build_engine(entry, context)
        if entry.weight_sync:
            self.sharding_manager = FSDPShardingManager(
                self.actor.module,
                engine,
                bucket_bytes=r.weight_sync_bucket_mb * 2**20,
                device=self.device,
                dtype=getattr(torch, r.dtype),
                lora_sync=lora_sync,
            )
        return maybe_multi_turn(engine, r.multi_turn, tokenizer_path=spec.model_path)

    def _build_engine(self, entry: RolloutEngineSpec, context: EngineContext) -> RolloutEngine:
        """The entry's sync engine, or with ``rollout.mode=async`` its async one (``async_target``)."""
        if self.spec.rollout.mode != "async":
            engine: RolloutEngine = entry.load()(context)
            return engine
        async_engine: RolloutEngine = entry.load_async()(context)
        return async_engine

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("generate")
    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Rollout of ``prompts`` with ``sampling`` (None: the engine's defaults); ``step`` reseeds the engine
        from (seed, step) so a resumed run resamples the uninterrupted run's responses. The actor's log-probs
        are their own stage (:meth:`compute_log_prob`).
        """
        self._need("rollout", "generate_sequences")
        assert self.rollout is not None
        prompts = prompts.to(self.device)
        if self.sharding_manager is not None:
            with self.sharding_manager:  # syncs the actor's weights into the engine when they changed
                out = self.rollout.generate_sequences(prompts, sampling, step)
            timing = dict(out.meta_info.get("timing") or {})
            timing["update_weights"] = float(self.sharding_manager.last_metrics.get("timing_s/update_weights", 0.0))
        else:
            out = self.rollout.generate_sequences(prompts, sampling, step)
            timing = dict(out.meta_info.get("timing") or {})
        out.meta_info["timing"] = timing
        if self.spec.live_metrics:
            self._publish_rollout_metrics(out, timing)
        return out.to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("generate_submit")
    def submit_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Syncs the weights into the engine (when they changed), starts the rollout of ``prompts`` in the
        background and returns at once (a receipt; :meth:`RolloutPrefetch.submit`). Same inputs and seeding as
        :meth:`generate_sequences`. Needs ``rollout.mode=async``: an engine that generates in its own process.

        The engine generates while the ranks run the step's forwards and update, with the weights of this call,
        and stays awake across steps (no sleep / wake-up per step); a ``generate_sequences`` call (validation)
        puts it to sleep after.
        """
        self._need("rollout", "submit_sequences")
        if self.spec.rollout.mode != "async":
            raise RuntimeError(
                "submit_sequences needs rollout.mode=async (an engine generating outside the trained module); "
                "set rollout.mode=async or trainer.pipeline=sync"
            )
        assert self.rollout is not None and self.sharding_manager is not None
        # Wake (a no-op when awake) + weight sync (when the actor changed) here, on the method thread, so the
        # all-gathers never run beside another call's collectives. No exit in collect: the next submit follows.
        self.sharding_manager.__enter__()
        sync_s = float(self.sharding_manager.last_metrics.get("timing_s/update_weights", 0.0))
        return self.prefetch.submit(self.rollout, prompts.to(self.device), sync_s=sync_s, sampling=sampling, step=step)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("generate_collect")
    def collect_sequences(self, prompts: DataProto) -> DataProto:
        """Waits for the rollout :meth:`submit_sequences` started and returns it (:meth:`RolloutPrefetch.collect`:
        ``prompts`` must be the submitted rows)."""
        self._need("rollout", "collect_sequences")
        return self.prefetch.collect(prompts)

    def _publish_rollout_metrics(self, out: DataProto, timing: dict[str, float]) -> None:
        from workers.live_metrics import RolloutMetrics

        if self.live is None:
            self.live = RolloutMetrics(engine=self.spec.rollout.engine, rank=self.rank)
        batch = out.batch
        mask = batch["response_mask"] if batch is not None and "response_mask" in batch.keys() else None
        sync = self.sharding_manager.last_metrics if self.sharding_manager is not None else {}
        self.live.publish(
            generate_s=float(timing.get("generate_sequences", 0.0)),
            response_tokens=int(mask.sum()) if mask is not None else 0,
            sequences=len(out),
            sync=sync,
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("old_log_prob")
    def compute_log_prob(self, data: DataProto, temperature: float = 1.0, step: int | None = None) -> DataProto:
        """``old_log_probs`` (B, R): the actor's log-probs of the responses, logits divided by ``temperature``.

        ``step`` only labels the call (profiling); micro-batches follow ``plan.actor.log_prob``.
        """
        self._need("actor", "compute_log_prob")
        assert self.actor is not None
        start = time.perf_counter()
        old, _ = self.actor.compute_log_prob(data.to(self.device), temperature=temperature)
        timing = {"old_log_prob": time.perf_counter() - start}
        return DataProto.from_dict({"old_log_probs": old.cpu()}, meta_info={"timing": timing})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("ref")
    def compute_ref_log_prob(self, data: DataProto, temperature: float = 1.0, step: int | None = None) -> DataProto:
        """``ref_log_prob`` (B, R) under the frozen reference policy, micro-batched by ``plan.ref``."""
        self._need("ref", "compute_ref_log_prob")
        assert self.ref is not None
        start = time.perf_counter()
        with self._reference_forward():
            log_prob, _ = self.ref.compute_log_prob(
                data.to(self.device), temperature=temperature, forward=self.spec.plan.ref
            )
        timing = {"ref": time.perf_counter() - start}
        return DataProto.from_dict({"ref_log_prob": log_prob.cpu()}, meta_info={"timing": timing})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @monitored("update_actor", report=True)
    def update_actor(self, data: DataProto, temperature: float = 1.0, step: int | None = None) -> DataProto:
        """One PPO update at the rollout ``temperature``, its mini-batch shuffle seeded by ``step`` (None: the
        count of updates); returns ``actor/*`` and ``perf/*`` metrics in ``meta_info``."""
        self._need("actor", "update_actor")
        assert self.actor is not None
        start = time.perf_counter()
        # fsdp.optimizer_offload: Adam state on the host except from the first optimizer step to the update's end.
        with optimizer_offload(self.actor.optimizer, enabled=self.spec.actor.fsdp.optimizer_offload):
            metrics = self.actor.update_policy(data.to(self.device), temperature=temperature, step=step)
        seconds = time.perf_counter() - start
        flops = self.flops.train_flops(self.actor.last_update_seq_lens) / self.actor.sp_size  # SP: 1/sp each
        metrics["perf/mfu/actor"] = mfu(flops=flops, seconds=seconds, device=self.device)
        metrics.update(memory_metrics(self.device, prefix="perf"))
        metrics["timing_s/worker/update_actor"] = seconds
        metrics["perf/torch_threads"] = float(torch.get_num_threads())  # resources.num_cpus_per_worker took effect
        if self.device.type == "cpu":  # the process's high-water mark (Linux ru_maxrss is KiB)
            metrics["perf/cpu_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if self.sharding_manager is not None:
            self.sharding_manager.mark_dirty()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer + scheduler of the actor under ``path`` (one writer per rank)."""
        self._need("actor", "save_checkpoint")
        assert self.actor is not None and self.actor.optimizer is not None
        save_role_checkpoint(
            path,
            self.actor.module,
            self.actor.optimizer,
            self.actor.lr_scheduler,
            adapter_only=self.spec.model.lora.save_adapter_only,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Loads a checkpoint written by any world size (DCP reshards)."""
        self._need("actor", "load_checkpoint")
        assert self.actor is not None and self.actor.optimizer is not None
        load_role_checkpoint(path, self.actor.module, self.actor.optimizer, self.actor.lr_scheduler)
        if self.sharding_manager is not None:
            self.sharding_manager.mark_dirty()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> RankUpload:
        """Without a shared filesystem: this rank's shards on its node, uploaded to ``ckpt.remote_url``."""
        self._need("actor", "save_checkpoint_to_store")
        assert self.actor is not None and self.actor.optimizer is not None
        module, optimizer, scheduler = self.actor.module, self.actor.optimizer, self.actor.lr_scheduler
        adapter_only = self.spec.model.lora.save_adapter_only
        return save_role_to_store(ckpt, role, module, optimizer, scheduler, adapter_only=adapter_only)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None:
        """Without a shared filesystem: loads the node's copy of ``ckpt.remote_url`` (downloaded once per node)."""
        self.load_checkpoint(fetch_role_dir(ckpt, role))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the actor's full weights on CPU from rank 0 (``{}`` from the others), to check exports."""
        self._need("actor", "full_state_dict")
        assert self.actor is not None
        return gather_full_state_dict(self.actor.module)
