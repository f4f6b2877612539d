"""The typed configuration of one RLHF run.

Every section is a frozen pydantic model with ``extra="forbid"``: an unknown key is an error, not a
silently ignored typo. Field names follow verl where verl has one, so recipes port by renaming the
root (``actor_rollout_ref.actor.ppo_mini_batch_size`` becomes ``actor.ppo_mini_batch_size``).
Cross-field rules (divisibility, estimator needs) live in :mod:`rlhf_ops.config.validate`; derived
sizes in :mod:`rlhf_ops.config.batch_plan`. Workers receive their own section, never the root.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlhf_ops.config.async_trainer import ASYNC_DOC, PIPELINE_DOC, AsyncRolloutConfig
from rlhf_ops.config.faults import FaultToleranceKeys
from rlhf_ops.config.lora import LORA_SYNC_DOC, LoraSync
from rlhf_ops.config.lora import LoraConfig as LoraConfig
from rlhf_ops.config.multi_turn import MultiTurnConfig
from rlhf_ops.config.off_policy import Pipeline, RolloutCorrectionConfig
from rlhf_ops.config.reproducibility import ReproducibilityKeys
from rlhf_ops.config.section import (
    DEFAULT_LOGGERS,
    FREE_CACHE_ENGINE_DOC,
    KV_BLOCK_SIZE_DOC,
    AdvEstimator,
    DType,
    KLPenalty,
    LoggerName,
    LossAggMode,
    PathComponent,
    PolicyLossName,
    RolloutEngineName,
    Section,
    not_blank,
)
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS


class ModelConfig(Section):
    """The policy model. ``builtin:tiny-llama`` / ``builtin:tiny-vlm`` build tiny test models locally (no hub)."""

    path: str = Field(
        ..., min_length=1, description="Local HF model directory, or 'builtin:tiny-llama' / 'builtin:tiny-vlm'."
    )
    modality: Literal["auto", "text", "vision_language"] = Field(
        "auto",
        description="auto: vision_language when config.json has a vision_config (AutoModelForImageTextToText), "
        "else text (AutoModelForCausalLM); an explicit value must match the model.",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer directory; defaults to model.path.")
    dtype: DType = Field(
        "float32",
        description=(
            "Compute dtype of the FSDP roles (bfloat16 = mixed precision: FSDP2 MixedPrecisionPolicy on GPU, "
            "bf16 autocast on CPU). Master weights and optimizer state stay fp32 (see <role>.fsdp.master_dtype)."
        ),
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = Field(
        "sdpa", description="HF attention kernel; flash_attention_2 needs flash-attn (GPU image)."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model directory.")
    use_liger: bool = Field(
        False,
        description="Patch the model with liger-kernel's fused Triton kernels (RMSNorm, SwiGLU, RoPE); CUDA only, "
        "needs the liger-kernel package (GPU image).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


class DataConfig(Section):
    """Prepared datasets (see ``rlhf prepare-data``) and their field names."""

    train_files: list[str] = Field(..., min_length=1, description="Parquet/JSONL URLs, or 'builtin:<toy task>'.")
    val_files: list[str] = Field(default_factory=list, description="Validation files; empty disables validation.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (text or chat messages).")
    ground_truth_key: str = Field("ground_truth", description="Column passed to reward functions.")
    data_source_key: str = Field("data_source", description="Column naming the source (metrics per source).")
    max_prompt_length: int = Field(64, gt=0, description="Prompts longer than this (tokens) are rejected.")
    train_batch_size: int = Field(16, gt=0, description="Prompts per training step (before n samples).")
    val_batch_size: int | None = Field(None, gt=0, description="Prompts per validation batch; None = all at once.")
    shuffle: bool = Field(True, description="Shuffle the training set each epoch (seeded by trainer.seed).")
    apply_chat_template: bool = Field(True, description="Use the tokenizer's chat template when it has one.")
    toy_rows: int = Field(512, gt=0, description="Rows generated for a builtin toy task.")


class KLControllerConfig(Section):
    """Coefficient of KL-in-reward: fixed, or adaptive towards ``target_kl`` over ``horizon`` samples."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0.0, description="Initial (or fixed) beta.")
    target_kl: float = Field(0.1, gt=0.0, description="Adaptive: KL the controller steers towards.")
    horizon: int = Field(10000, gt=0, description="Adaptive: samples over which beta moves.")


class FilterGroupsConfig(Section):
    """DAPO dynamic sampling: drop groups whose samples all score the same, refill from the next prompts."""

    enable: bool = Field(False, description="Drop zero-variance groups and generate more prompts to refill the step.")
    metric: str = Field(
        "score",
        min_length=1,
        description="Per-sample value compared within a group: 'score' (summed token_level_scores) or a key the "
        "reward function returns in its dict (e.g. 'acc').",
    )
    max_num_gen_batches: int = Field(
        4,
        ge=1,
        description="Generation rounds per step at most (the first included); when reached, the step is filled "
        "up with dropped groups (zero advantage under group estimators).",
    )


class AlgorithmConfig(Section):
    """RL algorithm: advantage estimator, KL regularisation and the clipped policy loss."""

    adv_estimator: AdvEstimator = Field("grpo", description="Advantage estimator; 'gae' needs the critic.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(True, description="False gives Dr.GRPO (no std normalisation).")
    use_kl_in_reward: bool = Field(False, description="Subtract beta * KL(actor || ref) from token rewards.")
    kl_penalty: KLPenalty = Field("kl", description="KL estimator used in the reward.")
    kl_ctrl: KLControllerConfig = Field(default_factory=KLControllerConfig)
    use_kl_loss: bool = Field(False, description="Add kl_loss_coef * KL(actor || ref) to the actor loss.")
    kl_loss_coef: float = Field(0.001, ge=0.0, description="Weight of the KL loss.")
    kl_loss_type: KLPenalty = Field("low_var_kl", description="KL estimator used in the loss (k3 = low_var_kl).")
    policy_loss: PolicyLossName = Field("vanilla", description="PPO clip (vanilla), gspo, clip_cov, kl_cov, cispo.")
    clip_cov_ratio: float = Field(
        0.0002, gt=0.0, le=1.0, description="Clip-Cov: share of tokens whose loss is dropped."
    )
    clip_cov_lb: float = Field(1.0, description="Clip-Cov: lower covariance bound of the candidate tokens.")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov: upper covariance bound of the candidate tokens.")
    kl_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="KL-Cov: share of tokens given the KL penalty.")
    ppo_kl_coef: float = Field(1.0, ge=0.0, description="KL-Cov: weight of |log_prob - old_log_prob| on those tokens.")
    tis_imp_ratio_cap: float | None = Field(
        None,
        gt=0.0,
        description="Truncated importance sampling: weight token losses by min(pi_old / pi_rollout, cap) "
        "(rollout engine vs trainer mismatch); None = off, 2 is typical.",
    )
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    ppo_target_kl: float | None = Field(
        None,
        gt=0.0,
        description="KL early stop: when a mini-batch's ppo_kl exceeds kl_early_stop_factor x this, its optimizer "
        "step is skipped and the step's remaining mini-batches and PPO epochs are ended; None = off.",
    )
    kl_early_stop_factor: float = Field(1.5, gt=0.0, description="KL early stop threshold factor (x ppo_target_kl).")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    clip_ratio_low: float = Field(0.2, gt=0.0, description="Lower clip: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, gt=0.0, description="Upper clip: ratio <= 1 + clip_ratio_high.")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="Dual-clip bound for negative advantages (> 1).")
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus weight.")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How token losses are aggregated.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch.")


class OptimConfig(Section):
    """AdamW with warm-up and a constant or cosine schedule."""

    lr: float = Field(1e-6, gt=0.0, description="Peak learning rate.")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps (optimizer steps).")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")


class MixedPrecisionConfig(Section):
    """Compute precision of one role (see :mod:`rlhf_ops.config.precision`). Losses always see fp32 logits."""

    param_dtype: DType | None = Field(
        None,
        description=(
            "Compute dtype of forward/backward; None = model.dtype. On GPU the FSDP2 MixedPrecisionPolicy "
            "param_dtype (params gathered in it); on CPU bfloat16 means torch.autocast (bf16 matmuls)."
        ),
    )
    reduce_dtype: DType = Field("float32", description="Dtype of the gradient reduce-scatter / all-reduce.")


class FSDPWrapPolicyConfig(Section):
    """Which modules get their own ``fully_shard`` (one all-gather / reduce-scatter unit each)."""

    transformer_layer_cls_to_wrap: list[str] | None = Field(
        None, description="Module class names to wrap; None uses the model's _no_split_modules (decoder blocks)."
    )
    min_num_params: int = Field(
        0,
        ge=0,
        description="> 0: wrap by size instead, bottom-up: a module is wrapped when its parameters not already in "
        "a wrapped descendant number at least this (torch's size_based_auto_wrap_policy rule).",
    )


class FSDPConfig(Section):
    """FSDP2 options for one role."""

    param_offload: bool = Field(False, description="CPUOffloadPolicy: params and grads live on the host.")
    optimizer_offload: bool = Field(False, description="Move optimizer state to the host between updates.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder block in backward.")
    reshard_after_forward: bool = Field(True, description="Free gathered params after forward (ZeRO-3).")
    grad_sync_last_micro_batch: bool = Field(
        False,
        description="Reduce-scatter the gradients once per mini-batch instead of after every micro-batch (FSDP2 "
        "set_requires_gradient_sync): fewer copies and collectives, +1 unsharded gradient held meanwhile.",
    )
    single_rank_plain: bool = Field(
        False,
        description="One rank: plain parameters, no FSDP2 (which would only copy them and their gradients there); "
        "checkpoints stay DCP and resume on any number of ranks. Ignored with more ranks or GPU bf16.",
    )
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    master_dtype: DType | None = Field(
        None,
        description=(
            "Dtype of the sharded weights the optimizer steps (and of its state); None = float32 for trained "
            "roles (actor, critic) and the compute dtype for the reference on GPU. Below float32 on a trained "
            "role logs a warning: small AdamW updates round to zero."
        ),
    )
    hsdp_replicate_size: int = Field(
        1, gt=0, description="HSDP: replicate across this many groups, shard within each (1 = plain FSDP)."
    )
    fsdp_size: int = Field(
        -1,
        description="Shard-group size (verl's name): -1 shards over all ranks; k > 0 shards within groups of k "
        "ranks and replicates across the world / k groups (HSDP). Exclusive with hsdp_replicate_size.",
    )
    forward_prefetch: int = Field(
        0,
        ge=0,
        description="0: FSDP2's implicit forward prefetch; N >= 1: each block explicitly prefetches the next N "
        "blocks' all-gathers (issued earlier from the CPU; N >= 2 overlaps more and holds more memory).",
    )
    backward_prefetch: int = Field(
        1,
        ge=1,
        description="Backward prefetch depth: 1 is FSDP2's default (the previous block's all-gather is issued "
        "early); N > 1 prefetches the previous N blocks explicitly (more overlap, more memory).",
    )
    wrap_policy: FSDPWrapPolicyConfig = Field(default_factory=FSDPWrapPolicyConfig)


class ActorConfig(Section):
    """Actor (policy) training: batch sizes, optimizer, FSDP, efficiency options."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    grad_clip: float = Field(1.0, gt=0.0, description="Max global grad norm.")
    ppo_mini_batch_size: int = Field(16, gt=0, description="Prompts per optimizer step (x rollout.n sequences).")
    ppo_micro_batch_size_per_gpu: int = Field(4, gt=0, description="Sequences per forward/backward per rank.")
    log_prob_micro_batch_size_per_gpu: int = Field(8, gt=0, description="Sequences per log-prob forward.")
    use_dynamic_bsz: bool = Field(False, description="Form micro-batches by a token budget instead of a count.")
    ppo_max_token_len_per_gpu: int = Field(16384, gt=0, description="Token budget per micro-batch (update).")
    log_prob_max_token_len_per_gpu: int = Field(16384, gt=0, description="Token budget per log-prob micro-batch.")
    use_remove_padding: bool = Field(False, description="Run forward on packed sequences (no pad tokens).")
    ulysses_sequence_parallel_size: int = Field(1, gt=0, description="Ranks sharing one sequence (Ulysses).")
    shuffle: bool = Field(False, description="Shuffle sequences before splitting into mini-batches.")
    share_prompt_prefix: bool = Field(
        False,
        description="Forward each distinct prompt of a micro-batch once and attend its rollout.n responses to it "
        "(one packed row with an explicit mask): exact, and the prompt's share of the actor's and the reference's "
        "forward/backward drops n-fold. Needs attn_implementation sdpa or eager, no Ulysses, a text policy; "
        "micro-batches should hold whole groups (ppo_micro_batch_size_per_gpu a multiple of rollout.n).",
    )
    share_prompt_attention: Literal["dense", "per_prompt"] = Field(
        "dense",
        description="With share_prompt_prefix, how the packed row's attention runs (actor and reference): dense "
        "(sdpa over the whole row's N x N mask) or per_prompt (sdpa per prompt group, each prompt with its own "
        "responses: the same values to float rounding, sum of n_g^2 scores instead of N^2; pays with several "
        "prompts per micro-batch). Needs attn_implementation sdpa.",
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class CriticConfig(Section):
    """Value model (PPO with GAE only)."""

    model_path: str | None = Field(None, description="Critic init weights; defaults to model.path.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    grad_clip: float = Field(1.0, gt=0.0)
    cliprange_value: float = Field(0.5, gt=0.0, description="Value clip around the old values.")
    ppo_mini_batch_size: int = Field(16, gt=0)
    ppo_micro_batch_size_per_gpu: int = Field(4, gt=0)
    log_prob_micro_batch_size_per_gpu: int = Field(8, gt=0, description="Sequences per value forward.")
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = Field(32768, gt=0)
    use_remove_padding: bool = False
    ulysses_sequence_parallel_size: int = Field(1, gt=0)
    share_prompt_prefix: bool = Field(
        False, description="As actor.share_prompt_prefix, for the value forward and its backward."
    )
    share_prompt_attention: Literal["dense", "per_prompt"] = Field(
        "dense", description="As actor.share_prompt_attention, for the value model."
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RefConfig(Section):
    """Reference policy (frozen copy of the initial actor; adapters disabled under LoRA)."""

    log_prob_micro_batch_size_per_gpu: int = Field(8, gt=0)
    log_prob_max_token_len_per_gpu: int = Field(16384, gt=0)
    fsdp: FSDPConfig = Field(default_factory=lambda: FSDPConfig(param_offload=False))


class SamplingConfig(Section):
    """Sampling parameters (used for validation; training uses the rollout's own)."""

    n: int = Field(1, gt=0)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    do_sample: bool = False


class RolloutConfig(Section):
    """Generation engine and sampling."""

    engine: RolloutEngineName = Field("hf", description="'hf' (transformers), 'vllm', 'sglang' (GPU) or a plug-in.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="'sync': the in-process vLLM LLM (or the HF engine); 'async': a vLLM AsyncLLM (engine core in "
        "its own process, one request per sample). 'async' needs engine=vllm.",
    )
    n: int = Field(1, gt=0, description="Samples per prompt; group estimators need >= 2.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_new_tokens: int = Field(16, gt=0, description="Response length limit (tokens).")
    dtype: DType = Field("float32", description="Engine dtype (fp32 on CPU).")
    tensor_model_parallel_size: int = Field(1, gt=0, description="vLLM TP across ranks of a rollout group.")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM on GPU.")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="vLLM KV cache size (CPU needs it small).")
    enforce_eager: bool = Field(True, description="vLLM: disable CUDA graphs.")
    kv_block_size: int | None = Field(None, gt=0, multiple_of=16, description=KV_BLOCK_SIZE_DOC)
    free_cache_engine: bool = Field(True, description=FREE_CACHE_ENGINE_DOC)
    weight_sync_bucket_mb: int = Field(256, gt=0, description="Max bytes gathered at once when syncing weights.")
    lora_sync: LoraSync = Field("auto", description=LORA_SYNC_DOC)
    val_kwargs: SamplingConfig = Field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment on the rule reward (verl's ``reward_model.overlong_buffer``):
    a response of L tokens gets ``min(0, -(L - (max_new_tokens - len)) / len * penalty_factor)`` added:
    0 up to ``rollout.max_new_tokens - len`` tokens, then linearly down to ``-penalty_factor``.
    """

    enable: bool = Field(False, description="Add the overlong penalty to reward.reward_fn's score.")
    len: int = Field(0, ge=0, description="Buffer (tokens) before rollout.max_new_tokens where the penalty ramps.")
    penalty_factor: float = Field(1.0, ge=0.0, description="Penalty at rollout.max_new_tokens (score - factor).")


class RewardConfig(Section):
    """Reward: a sequence-classification reward model and/or a rule function (summed)."""

    model_path: str | None = Field(None, description="HF sequence-classification reward model directory.")
    reward_fn: Annotated[
        str | None,
        not_blank("set a built-in name or 'pkg.module:function', or null to score with reward.model_path only"),
    ] = Field(
        None,
        description="Built-in (default, gsm8k, gsm8k_flexible, math, multiple_choice, format, toy...) or "
        "dotted path 'pkg.module:function' with verl's (data_source, solution_str, ground_truth, extra_info).",
    )
    micro_batch_size_per_gpu: int = Field(8, gt=0)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    fsdp: FSDPConfig = Field(
        default_factory=lambda: FSDPConfig(param_offload=False),
        description="FSDP2 of the reward model (frozen: no optimizer), its own section (it once borrowed ref.fsdp).",
    )


class ResourcesConfig(Section):
    """Where workers run."""

    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(2, gt=0, description="Worker ranks per node (one per GPU on GPU clusters).")
    device: Literal["cpu", "cuda"] = Field("cpu")
    num_cpus_per_worker: float = Field(
        0.5,
        gt=0.0,
        description="Ray CPU request per rank (fractional on CPU); its floor (at least 1) is also the rank's "
        "intra-op threads (torch.set_num_threads, OMP_NUM_THREADS).",
    )
    gpus_per_worker: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description=(
            "Ray GPU request per rank with device=cuda; below 1 ranks share a GPU (0.5: two per GPU). NCCL refuses "
            "two ranks on one device, so shared GPUs use gloo (CUDA tensors staged through the host): for checks."
        ),
    )
    ray_address: str | None = Field(None, description="Ray cluster address; None starts or joins a local one.")
    metrics_export_port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None,
        description="Port of the Prometheus endpoint (/metrics) of the local Ray cluster a run starts: "
        "trainer.logger prometheus (docs/live_metrics.md). None: Ray picks one. A joined cluster keeps its own.",
    )
    placement_timeout_s: float = Field(
        900.0,
        gt=0.0,
        description="Seconds the run waits for the cluster to grant its ranks' bundles before it fails; a run "
        "queued behind other runs on a full cluster waits this long.",
    )

    @property
    def threads_per_worker(self) -> int:
        """Intra-op threads of each worker process: whole CPUs it requested, at least 1 (0.5 CPU -> 1)."""
        return max(1, int(self.num_cpus_per_worker))


class TrainerConfig(FaultToleranceKeys, ReproducibilityKeys):
    """The controller loop, checkpoints and resume (more keys: rlhf_ops.config.faults and .reproducibility)."""

    experiment_name: PathComponent = Field(
        "rlhf", description="Folder under checkpoint_root (and the remote store): one path component."
    )
    run_name: PathComponent = Field(
        "run", description="Checkpoint folder name under the experiment: one path component."
    )
    total_epochs: int = Field(1, gt=0)
    total_training_steps: int | None = Field(None, gt=0, description="Stop after this many steps (caps epochs).")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    test_freq: int = Field(0, ge=0, description="Validate every N steps (0 = never during training).")
    val_before_train: bool = False
    checkpoint_root: Annotated[str, not_blank("set a folder, e.g. 'checkpoints'")] = Field(
        "checkpoints", description="Local folder for checkpoints."
    )
    remote_store_url: Annotated[str | None, not_blank("set a URL, or null to keep checkpoints local only")] = Field(
        None,
        description="URL to sync to: file://, s3://, hdfs://, webhdfs:// or any protocol whose fsspec "
        "implementation is installed (gs:// with gcsfs, abfs:// with adlfs...).",
    )
    shared_checkpoint_root: bool = Field(
        True,
        description="Whether every node and the driver see the same checkpoint_root (a shared filesystem, or one "
        "machine). false: each rank writes its shards on its own node (node_checkpoint_root), uploads them to "
        "remote_store_url and deletes its copy; the driver writes the manifest there after every rank's upload; "
        "resume downloads from the store onto each node. Needs remote_store_url.",
    )
    node_checkpoint_root: Annotated[str | None, not_blank("set a folder, or null to use checkpoint_root")] = Field(
        None,
        description="With shared_checkpoint_root=false: the folder on each rank's own node its shards are written "
        "to before the upload (None: checkpoint_root, as a path on that node). '{rank}' in it becomes the rank, "
        "one folder per rank: to stand for separate nodes on one machine (tests).",
    )
    keep_last: int = Field(0, ge=0, description="Keep the last K checkpoints (0 keeps all).")
    resume_mode: str = Field("auto", description="'auto', 'disable', or a checkpoint path/URL.")
    save_hf_model: bool = Field(False, description="Also write an HF export at each save.")
    balance_batch: bool = Field(True, description="Reorder each step's sequences so ranks get equal token counts.")
    seed: int = 1
    pipeline: Pipeline = Field("sync", description=PIPELINE_DOC)
    async_rollout: AsyncRolloutConfig = Field(default_factory=AsyncRolloutConfig, description=ASYNC_DOC)
    profile_steps: list[int] = Field(
        default_factory=list,
        description="Steps to trace with torch.profiler on every rank of every role (Chrome traces, logged as "
        "MLflow artifacts under profiles/); empty = off.",
    )
    profile_dir: str = Field("profiles", description="Local folder for the traces (one per step, role and rank).")
    logger: list[LoggerName] = Field(
        default_factory=lambda: list(DEFAULT_LOGGERS),
        description="Where step metrics go: console, jsonl (run folder), mlflow, prometheus (live: Ray gauges on "
        "each node's metrics export port, with the rollout engines' own metrics; docs/live_metrics.md).",
    )


class TrackingConfig(Section):
    """MLflow."""

    mlflow_uri: Annotated[
        str | None,
        not_blank("set an http(s)://, file:// or database URI, or null to use MLFLOW_TRACKING_URI"),
    ] = Field(None, description="Tracking URI; None uses MLFLOW_TRACKING_URI.")
    experiment: str = Field("rlhf", min_length=1)


class RunConfig(Section):
    """One RLHF run, fully resolved."""

    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @property
    def world_size(self) -> int:
        return self.resources.nnodes * self.resources.nproc_per_node

    @property
    def needs_critic(self) -> bool:  # the estimator's table entry (a user's that does not import: pre-flight)
        return bool(getattr(ADVANTAGE_ESTIMATORS.find(self.algorithm.adv_estimator), "needs_critic", False))

    @property
    def needs_ref(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.algorithm.use_kl_loss
