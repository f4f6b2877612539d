"""verl's configuration keys and their counterparts here: the one table behind verl compatibility.

Every key of verl's ``ppo_trainer.yaml`` (and the keys its example scripts set) is one entry:

- :class:`Carry`: the key has a counterpart; its value (converted where the two differ, e.g. ``-1`` = never)
  is written to the native key(s). ``refuse`` names values that have no counterpart (``rollout.name=trtllm``).
- :class:`Drop`: no counterpart. Values in ``inert`` are this platform's behaviour anyway (``strategy=fsdp``,
  ``critic_warmup=0``) and are accepted with no effect; any other value is refused in one line that says why
  and names the closest native key.

A key ending in ``.*`` covers everything under it. Values that are unset in verl (``null``) or Hydra
interpolations (``${...}``, which only follow another key) are accepted with no effect everywhere.
:mod:`rlhf_ops.config.verl_compat` reads this table for the command line and YAML, ``rlhf config from-verl``
for scripts, and ``scripts/gen_verl_docs.py`` for ``docs/verl_migration.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SKIP: Any = object()  # a converter's answer: this value means "the native default" (e.g. verl's -1 = unset)


@dataclass(frozen=True)
class Carry:
    """A verl key with a counterpart: ``native`` (one key, or several that the value sets together)."""

    native: str | tuple[str, ...]
    convert: Callable[[Any], Any] | None = None
    note: str = ""
    refuse: dict[str, str] = field(default_factory=dict)  # value -> why it has no counterpart

    @property
    def natives(self) -> tuple[str, ...]:
        return (self.native,) if isinstance(self.native, str) else self.native


@dataclass(frozen=True)
class Drop:
    """A verl key with no counterpart: refused unless its value is in ``inert``; ``native`` is the closest key."""

    reason: str
    native: str | None = None
    inert: tuple[Any, ...] = ()


Entry = Carry | Drop

# --- value converters (verl's conventions to ours) ---------------------------------------------------------
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


def dtype(value: Any) -> Any:
    """verl's short dtype names (``bf16``, ``fp32``) to torch's (``bfloat16``, ``float32``)."""
    return _DTYPES.get(str(value), value)


def never_is_zero(value: Any) -> Any:
    """verl's ``-1`` (never) is ``0`` here (``save_freq=0``: only at the end; ``test_freq=0``: never)."""
    return 0 if isinstance(value, int) and value < 0 else value


def unset_if_negative(value: Any) -> Any:
    """verl's ``-1`` means "not set": keep the native default."""
    return SKIP if isinstance(value, int | float) and value < 0 else value


def as_list(value: Any) -> Any:
    """verl takes one file or a list; the keys here take a list."""
    return [value] if isinstance(value, str) else value


def prefetch_depth(value: Any) -> Any:
    """verl's boolean FSDP forward prefetch is a depth here (``True`` = prefetch the next block)."""
    return int(value) if isinstance(value, bool) else value


def loggers(value: Any) -> Any:
    """verl's loggers to ours: wandb / tensorboard / swanlab / ... become the MLflow tracker, others stay."""
    if not isinstance(value, (str, list, tuple)):
        return value  # no logger name or list (a number...): the schema refuses it, naming the key
    names = [value] if isinstance(value, str) else list(value)
    out = [name if name in ("console", "jsonl", "mlflow", "prometheus") else "mlflow" for name in names]
    return list(dict.fromkeys(out))


def resume_mode(value: Any) -> Any:
    """verl's ``resume_path`` mode is the path itself here (``trainer.resume_from_path`` carries it)."""
    return SKIP if value == "resume_path" else value


# --- groups of keys that repeat per role -----------------------------------------------------------------
_DEFAULTED = "not exposed here (or not a verl key: check its spelling)"
_MEGATRON = "Megatron-LM parallelism is not supported here (FSDP2 and Ulysses only)"
_NO_COMPILE = Drop("torch.compile is not applied here (no effect on results)", inert=(True, False))
_MEMORY_ONLY = Drop(
    "a verl memory saving with no effect on results; log-probs are computed in chunks here", inert=(True, False)
)


def _fsdp(verl: str, native: str) -> dict[str, Entry]:
    """FSDP options of one role (``<verl>.fsdp_config`` -> ``<native>.fsdp``)."""
    return {
        f"{verl}.param_offload": Carry(f"{native}.param_offload"),
        f"{verl}.optimizer_offload": Carry(f"{native}.optimizer_offload"),
        f"{verl}.reshard_after_forward": Carry(f"{native}.reshard_after_forward"),
        f"{verl}.fsdp_size": Carry(f"{native}.fsdp_size"),
        f"{verl}.forward_prefetch": Carry(f"{native}.forward_prefetch", prefetch_depth),
        f"{verl}.wrap_policy.min_num_params": Carry(f"{native}.wrap_policy.min_num_params"),
        f"{verl}.wrap_policy.transformer_layer_cls_to_wrap": Carry(
            f"{native}.wrap_policy.transformer_layer_cls_to_wrap"
        ),
        f"{verl}.model_dtype": Carry(f"{native}.master_dtype", dtype, "the dtype of the sharded weights"),
        f"{verl}.dtype": Carry(f"{native}.mixed_precision.param_dtype", dtype, "compute dtype"),
        f"{verl}.mixed_precision.param_dtype": Carry(f"{native}.mixed_precision.param_dtype", dtype),
        f"{verl}.mixed_precision.reduce_dtype": Carry(f"{native}.mixed_precision.reduce_dtype", dtype),
        f"{verl}.mixed_precision.buffer_dtype": Drop("buffers keep the model's dtype", inert=("fp32", "float32")),
        f"{verl}.offload_policy": Drop(
            "FSDP2's CPUOffloadPolicy is param_offload here", f"{native}.param_offload", inert=(False,)
        ),
        f"{verl}.strategy": Drop("FSDP2 is the only strategy here", inert=("fsdp", "fsdp2")),
        f"{verl}.ulysses_sequence_parallel_size": Drop(
            "Ulysses is set per role", native.replace(".fsdp", ".ulysses_sequence_parallel_size"), inert=(1,)
        ),
        f"{verl}.use_torch_compile": _NO_COMPILE,
        f"{verl}.entropy_from_logits_with_chunking": _MEMORY_ONLY,
        f"{verl}.entropy_checkpointing": _MEMORY_ONLY,
        f"{verl}.*": Drop(_DEFAULTED),
    }


def _optim(verl: str, native: str, grad_clip: str) -> dict[str, Entry]:
    """Optimizer of one role (``<verl>.optim`` -> ``<native>.optim``)."""
    return {
        f"{verl}.lr": Carry(f"{native}.lr"),
        f"{verl}.betas": Carry(f"{native}.betas"),
        f"{verl}.weight_decay": Carry(f"{native}.weight_decay"),
        f"{verl}.eps": Carry(f"{native}.eps"),
        f"{verl}.lr_warmup_steps": Carry(f"{native}.lr_warmup_steps", unset_if_negative),
        f"{verl}.lr_warmup_steps_ratio": Drop("warm-up is set in steps here", f"{native}.lr_warmup_steps", (0, 0.0)),
        f"{verl}.min_lr_ratio": Carry(f"{native}.min_lr_ratio"),
        f"{verl}.lr_scheduler_type": Carry(f"{native}.lr_scheduler"),
        f"{verl}.warmup_style": Carry(f"{native}.lr_scheduler", note="verl's older name of lr_scheduler_type"),
        f"{verl}.clip_grad": Carry(grad_clip),
        f"{verl}.total_training_steps": Drop(
            "the schedule follows the run's length", "trainer.total_training_steps", inert=(-1,)
        ),
        f"{verl}.num_cycles": Drop("the cosine schedule is a half cycle here", inert=(0.5,)),
        f"{verl}.optimizer": Drop("AdamW is the optimizer here", inert=("AdamW", "adamw")),
        f"{verl}.optimizer_impl": Drop("torch.optim's AdamW is the optimizer here", inert=("torch.optim",)),
        f"{verl}.*": Drop(_DEFAULTED),
    }


_ROLLOUT = "actor_rollout_ref.rollout"
_VLLM_TUNING = "vLLM engine tuning is not exposed here (the engine's defaults apply)"

VERL_KEYS: dict[str, Entry] = {
    # --- model --------------------------------------------------------------------------------------------
    "actor_rollout_ref.model.path": Carry("model.path"),
    "actor_rollout_ref.model.tokenizer_path": Carry("model.tokenizer_path"),
    "actor_rollout_ref.model.trust_remote_code": Carry("model.trust_remote_code"),
    "actor_rollout_ref.model.use_remove_padding": Carry("actor.use_remove_padding"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Carry("actor.fsdp.activation_checkpointing"),
    "actor_rollout_ref.model.lora_rank": Carry("model.lora.rank"),
    "actor_rollout_ref.model.lora_alpha": Carry("model.lora.alpha"),
    "actor_rollout_ref.model.target_modules": Carry("model.lora.target_modules"),
    "actor_rollout_ref.model.use_liger": Carry("model.use_liger"),
    "actor_rollout_ref.model.lora.rank": Carry("model.lora.rank"),
    "actor_rollout_ref.model.lora.alpha": Carry("model.lora.alpha"),
    "actor_rollout_ref.model.lora.target_modules": Carry("model.lora.target_modules"),
    "actor_rollout_ref.model.use_fused_kernels": Drop("the fused log-prob kernel is always used", inert=(True, False)),
    "actor_rollout_ref.model.external_lib": Drop(
        "custom modelling code comes from the model folder", "model.trust_remote_code"
    ),
    "actor_rollout_ref.model.override_config": Drop("model config overrides are not supported", inert=({},)),
    "actor_rollout_ref.model.use_shm": Drop("models load from their folder", inert=(False,)),
    "actor_rollout_ref.model.enable_activation_offload": Drop("activation offload is not supported", inert=(False,)),
    "actor_rollout_ref.model.*": Drop(_DEFAULTED),
    "actor_rollout_ref.hybrid_engine": Drop("the actor and the rollout always share workers here", inert=(True,)),
    "actor_rollout_ref.nccl_timeout": Drop("the collective timeout is not exposed", inert=(600,)),
    # --- actor --------------------------------------------------------------------------------------------
    "actor_rollout_ref.actor.strategy": Drop(_MEGATRON, "actor.fsdp", inert=("fsdp", "fsdp2")),
    "actor_rollout_ref.actor.megatron.*": Drop(_MEGATRON, "actor.fsdp"),
    **_optim("actor_rollout_ref.actor.optim", "actor.optim", "actor.grad_clip"),
    **_fsdp("actor_rollout_ref.actor.fsdp_config", "actor.fsdp"),
    "actor_rollout_ref.actor.grad_clip": Carry("actor.grad_clip"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Carry("actor.ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Carry("actor.ppo_micro_batch_size_per_gpu"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Drop(
        "verl's deprecated global micro-batch size", "actor.ppo_micro_batch_size_per_gpu"
    ),
    "actor_rollout_ref.actor.use_dynamic_bsz": Carry("actor.use_dynamic_bsz"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Carry("actor.ppo_max_token_len_per_gpu"),
    "actor_rollout_ref.actor.ppo_epochs": Carry("algorithm.ppo_epochs"),
    "actor_rollout_ref.actor.shuffle": Carry("actor.shuffle"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Carry("actor.ulysses_sequence_parallel_size"),
    "actor_rollout_ref.actor.use_remove_padding": Carry("actor.use_remove_padding"),
    "actor_rollout_ref.actor.clip_ratio": Carry(("algorithm.clip_ratio_low", "algorithm.clip_ratio_high")),
    "actor_rollout_ref.actor.clip_ratio_low": Carry("algorithm.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": Carry("algorithm.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": Carry("algorithm.clip_ratio_c"),
    "actor_rollout_ref.actor.loss_agg_mode": Carry("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.entropy_coeff": Carry("algorithm.entropy_coeff"),
    "actor_rollout_ref.actor.use_kl_loss": Carry("algorithm.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": Carry("algorithm.kl_loss_coef"),
    "actor_rollout_ref.actor.kl_loss_type": Carry("algorithm.kl_loss_type"),
    "actor_rollout_ref.actor.tis_imp_ratio_cap": Carry("algorithm.tis_imp_ratio_cap", unset_if_negative),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Carry("algorithm.policy_loss"),
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": Carry("algorithm.clip_cov_ratio"),
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": Carry("algorithm.clip_cov_lb"),
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub": Carry("algorithm.clip_cov_ub"),
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": Carry("algorithm.kl_cov_ratio"),
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": Carry("algorithm.ppo_kl_coef"),
    "actor_rollout_ref.actor.policy_loss.*": Drop(_DEFAULTED, "algorithm.policy_loss"),
    "actor_rollout_ref.actor.checkpoint.save_lora_only": Carry("model.lora.save_adapter_only"),
    "actor_rollout_ref.actor.checkpoint.*": Drop("checkpoints always hold model, optimizer and trainer state"),
    "actor_rollout_ref.actor.profiler.*": Drop("profiling is set per run", "trainer.profile_steps"),
    "actor_rollout_ref.actor.entropy_coeff_schedule": Drop("the entropy bonus is constant", "algorithm.entropy_coeff"),
    "actor_rollout_ref.actor.use_torch_compile": _NO_COMPILE,
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": _MEMORY_ONLY,
    "actor_rollout_ref.actor.entropy_checkpointing": _MEMORY_ONLY,
    "actor_rollout_ref.actor.*": Drop(_DEFAULTED),
    # --- reference policy ---------------------------------------------------------------------------------
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Carry("ref.log_prob_micro_batch_size_per_gpu"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Carry("ref.log_prob_max_token_len_per_gpu"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Drop(
        "verl's deprecated global micro-batch size", "ref.log_prob_micro_batch_size_per_gpu"
    ),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Drop("follows actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    "actor_rollout_ref.ref.strategy": Drop(_MEGATRON, "ref.fsdp", inert=("fsdp", "fsdp2")),
    "actor_rollout_ref.ref.megatron.*": Drop(_MEGATRON, "ref.fsdp"),
    **_fsdp("actor_rollout_ref.ref.fsdp_config", "ref.fsdp"),
    "actor_rollout_ref.ref.use_torch_compile": _NO_COMPILE,
    "actor_rollout_ref.ref.*": Drop(_DEFAULTED),
    # --- rollout ------------------------------------------------------------------------------------------
    f"{_ROLLOUT}.name": Carry(
        "rollout.engine",
        refuse={"trtllm": "TensorRT-LLM rollout is not supported here"},
    ),
    f"{_ROLLOUT}.mode": Carry("rollout.mode"),
    f"{_ROLLOUT}.n": Carry("rollout.n"),
    f"{_ROLLOUT}.temperature": Carry("rollout.temperature"),
    f"{_ROLLOUT}.top_p": Carry("rollout.top_p"),
    f"{_ROLLOUT}.top_k": Carry("rollout.top_k"),
    f"{_ROLLOUT}.response_length": Carry("rollout.max_new_tokens"),
    f"{_ROLLOUT}.prompt_length": Drop("follows data.max_prompt_length", "data.max_prompt_length"),
    f"{_ROLLOUT}.dtype": Carry("rollout.dtype", dtype),
    f"{_ROLLOUT}.gpu_memory_utilization": Carry("rollout.gpu_memory_utilization"),
    f"{_ROLLOUT}.enforce_eager": Carry("rollout.enforce_eager"),
    f"{_ROLLOUT}.free_cache_engine": Carry("rollout.free_cache_engine"),
    f"{_ROLLOUT}.tensor_model_parallel_size": Carry("rollout.tensor_model_parallel_size"),
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu": Carry("actor.log_prob_micro_batch_size_per_gpu"),
    f"{_ROLLOUT}.log_prob_max_token_len_per_gpu": Carry("actor.log_prob_max_token_len_per_gpu"),
    f"{_ROLLOUT}.log_prob_micro_batch_size": Drop(
        "verl's deprecated global micro-batch size", "actor.log_prob_micro_batch_size_per_gpu"
    ),
    f"{_ROLLOUT}.log_prob_use_dynamic_bsz": Drop("follows actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    f"{_ROLLOUT}.do_sample": Drop("training rollouts always sample", "rollout.temperature", inert=(True,)),
    f"{_ROLLOUT}.ignore_eos": Drop("generation stops at EOS", inert=(False,)),
    f"{_ROLLOUT}.calculate_log_probs": Drop(
        "rollout log-probs are taken when a correction needs them", "algorithm.tis_imp_ratio_cap", inert=(True, False)
    ),
    f"{_ROLLOUT}.update_weights_bucket_megabytes": Carry("rollout.weight_sync_bucket_mb"),
    f"{_ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes": Carry("rollout.weight_sync_bucket_mb"),
    f"{_ROLLOUT}.val_kwargs.n": Carry("rollout.val_kwargs.n"),
    f"{_ROLLOUT}.val_kwargs.temperature": Carry("rollout.val_kwargs.temperature"),
    f"{_ROLLOUT}.val_kwargs.top_p": Carry("rollout.val_kwargs.top_p"),
    f"{_ROLLOUT}.val_kwargs.top_k": Carry("rollout.val_kwargs.top_k"),
    f"{_ROLLOUT}.val_kwargs.do_sample": Carry("rollout.val_kwargs.do_sample"),
    f"{_ROLLOUT}.multi_turn.enable": Carry("rollout.multi_turn.enable"),
    f"{_ROLLOUT}.multi_turn.max_assistant_turns": Carry("rollout.multi_turn.max_turns"),
    f"{_ROLLOUT}.multi_turn.*": Drop("tools and interactions are set by name here", "rollout.multi_turn.tools"),
    f"{_ROLLOUT}.data_parallel_size": Drop("rollout data parallelism follows the world size", inert=(1,)),
    f"{_ROLLOUT}.expert_parallel_size": Drop("expert parallelism is not supported", inert=(1,)),
    f"{_ROLLOUT}.pipeline_model_parallel_size": Drop("rollout pipeline parallelism is not supported", inert=(1,)),
    f"{_ROLLOUT}.engine_kwargs.*": Drop(_VLLM_TUNING, inert=({},)),
    f"{_ROLLOUT}.agent.*": Drop("the agent loop is rollout.multi_turn here", "rollout.multi_turn.enable"),
    f"{_ROLLOUT}.profiler.*": Drop("profiling is set per run", "trainer.profile_steps"),
    f"{_ROLLOUT}.*": Drop(_VLLM_TUNING),
    # --- data ---------------------------------------------------------------------------------------------
    "data.train_files": Carry("data.train_files", as_list),
    "data.val_files": Carry("data.val_files", as_list),
    "data.max_response_length": Carry("rollout.max_new_tokens"),
    "data.reward_fn_key": Carry("data.data_source_key"),
    "data.filter_overlong_prompts": Drop(
        "prompts over data.max_prompt_length are always rejected (rlhf prepare-data)", inert=(True, False)
    ),
    "data.filter_overlong_prompts_workers": Drop("prompts are filtered when the data is prepared", inert=(1,)),
    "data.truncation": Drop("over-long prompts are rejected, never truncated", "data.max_prompt_length", ("error",)),
    "data.return_raw_chat": Drop("prompts keep their chat form", inert=(True, False)),
    "data.return_raw_input_ids": Drop("the rollout re-tokenises nothing", inert=(False,)),
    "data.return_full_prompt": Drop("not needed here", inert=(False,)),
    "data.train_max_samples": Drop("limit rows when preparing the data (rlhf prepare-data --limit)", inert=(-1,)),
    "data.val_max_samples": Drop("limit rows when preparing the data (rlhf prepare-data --limit)", inert=(-1,)),
    "data.seed": Drop("one seed drives the run", "trainer.seed"),
    "data.*": Drop(_DEFAULTED),
    # --- critic -------------------------------------------------------------------------------------------
    "critic.strategy": Drop(_MEGATRON, "critic.fsdp", inert=("fsdp", "fsdp2")),
    "critic.megatron.*": Drop(_MEGATRON, "critic.fsdp"),
    "critic.enable": Drop(
        "the critic runs when algorithm.adv_estimator=gae", "algorithm.adv_estimator", (True, False)
    ),
    **_optim("critic.optim", "critic.optim", "critic.grad_clip"),
    **_fsdp("critic.model.fsdp_config", "critic.fsdp"),
    "critic.model.path": Carry("critic.model_path"),
    "critic.model.use_remove_padding": Carry("critic.use_remove_padding"),
    "critic.model.enable_gradient_checkpointing": Carry("critic.fsdp.activation_checkpointing"),
    "critic.model.*": Drop("the critic shares the policy's tokenizer and model options", "critic.model_path"),
    "critic.forward_micro_batch_size_per_gpu": Carry("critic.log_prob_micro_batch_size_per_gpu"),
    "critic.forward_max_token_len_per_gpu": Drop(
        "follows critic.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"
    ),
    "critic.ppo_epochs": Drop("the critic follows algorithm.ppo_epochs", "algorithm.ppo_epochs"),
    "critic.shuffle": Drop("the critic follows actor.shuffle", "actor.shuffle"),
    "critic.ppo_micro_batch_size": Drop(
        "verl's deprecated global micro-batch size", "critic.ppo_micro_batch_size_per_gpu"
    ),
    # --- reward -------------------------------------------------------------------------------------------
    "reward_model.enable": Drop(
        "a reward model is used when reward.model_path is set", "reward.model_path", (True, False)
    ),
    "reward_model.strategy": Drop(_MEGATRON, "reward.fsdp", inert=("fsdp", "fsdp2")),
    "reward_model.megatron.*": Drop(_MEGATRON, "reward.fsdp"),
    "reward_model.model.path": Carry("reward.model_path"),
    **_fsdp("reward_model.model.fsdp_config", "reward.fsdp"),
    "reward_model.micro_batch_size_per_gpu": Carry("reward.micro_batch_size_per_gpu"),
    "reward_model.reward_manager": Drop(
        "one reward manager here (DAPO's overlong penalty: reward.overlong_buffer)",
        "reward.reward_fn",
        ("naive", "dapo"),
    ),
    "reward_model.overlong_buffer.enable": Carry("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": Carry("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Carry("reward.overlong_buffer.penalty_factor"),
    "reward_model.rollout.*": Drop(
        "a generative reward model served by a rollout engine is not supported (a scoring model is)",
        "reward.model_path",
    ),
    "reward_model.use_reward_loop": Drop("rewards are scored by the trainer's reward step", inert=(True, False)),
    "reward_model.num_workers": Drop("rewards are scored by the trainer's reward step", inert=(1,)),
    "reward_model.launch_reward_fn_async": Drop("rewards are scored by the trainer's reward step", inert=(False,)),
    "reward_model.sandbox_fusion.*": Drop("code runs in this platform's sandbox (tools), not SandboxFusion"),
    "reward_model.*": Drop(_DEFAULTED, "reward"),
    "reward_manager.*": Drop("one reward manager here", "reward.reward_fn"),
    "custom_reward_function.path": Carry(
        "reward.reward_fn", note="with custom_reward_function.name: '<file stem>:<name>' (its folder on PYTHONPATH)"
    ),
    "custom_reward_function.name": Carry("reward.reward_fn", note="the function of custom_reward_function.path"),
    # --- algorithm (same names as here, except these) ------------------------------------------------------
    "algorithm.use_pf_ppo": Drop("prioritised replay is not supported", inert=(False,)),
    "algorithm.pf_ppo.*": Drop("prioritised replay is not supported"),
    # --- trainer ------------------------------------------------------------------------------------------
    "trainer.n_gpus_per_node": Carry("resources.nproc_per_node"),
    "trainer.nnodes": Carry("resources.nnodes"),
    "trainer.device": Carry("resources.device", refuse={"npu": "Ascend NPUs are not supported here"}),
    "trainer.project_name": Carry("tracking.experiment"),
    "trainer.logger": Carry("trainer.logger", loggers, "wandb, tensorboard, swanlab... become mlflow"),
    "trainer.save_freq": Carry("trainer.save_freq", never_is_zero),
    "trainer.test_freq": Carry("trainer.test_freq", never_is_zero),
    "trainer.resume_mode": Carry("trainer.resume_mode", resume_mode),
    "trainer.resume_from_path": Carry("trainer.resume_mode", note="the checkpoint to resume from"),
    "trainer.default_local_dir": Carry("trainer.checkpoint_root"),
    "trainer.default_hdfs_dir": Carry("trainer.remote_store_url"),
    "trainer.max_actor_ckpt_to_keep": Carry("trainer.keep_last"),
    "trainer.max_critic_ckpt_to_keep": Drop("one retention for every role", "trainer.keep_last"),
    "trainer.critic_warmup": Drop("the actor updates from the first step", inert=(0,)),
    "trainer.log_val_generations": Drop("validation generations are logged to MLflow", inert=(0,)),
    "trainer.rollout_data_dir": Drop("rollouts are logged to MLflow"),
    "trainer.validation_data_dir": Drop("validation generations are logged to MLflow"),
    "trainer.del_local_ckpt_after_load": Drop(
        "local checkpoints follow trainer.keep_last", "trainer.keep_last", (False,)
    ),
    "trainer.val_only": Drop("evaluate a checkpoint with the pipeline's evaluation task", inert=(False,)),
    "trainer.esi_redundant_time": Drop("time-based checkpoints are not exposed this way", inert=(0,)),
    "trainer.ray_wait_register_center_timeout": Drop("workers start with the run", "resources.placement_timeout_s"),
    "trainer.use_legacy_worker_impl": Drop("one worker implementation here", inert=("auto",)),
    "global_profiler.steps": Carry("trainer.profile_steps"),
    "global_profiler.*": Drop("torch.profiler traces are the profiler here", "trainer.profile_steps"),
    "ray_kwargs.*": Drop("Ray is joined by address", "resources.ray_address"),
    "ray_init.*": Drop("Ray is joined by address", "resources.ray_address"),
    "transfer_queue.*": Drop("batches move through Ray's object store", inert=(False,)),
    "async_training.partial_rollout": Carry("trainer.async_rollout.partial_rollout"),
    "async_training.staleness_threshold": Drop(
        "verl's share of stale samples per batch; the bound here is in policy versions",
        "trainer.async_rollout.max_staleness",
    ),
    "async_training.*": Drop(
        "verl's fully-async recipe; its counterpart is trainer.pipeline=async", "trainer.pipeline"
    ),
}

# Roots only verl has: a key under them that the table does not know is refused (never passed on).
VERL_ONLY_ROOTS = frozenset(key.split(".")[0] for key in VERL_KEYS) - {"data", "critic", "algorithm", "trainer"}
