"""The cost model applied to a run config: the prediction ``rlhf cost`` prints and the memory check pre-flight runs.

:func:`predict` reads the model's ``config.json``, the batch plan and the precision / placement keys, and asks
:mod:`rlhf_ops.cost_model` for per-rank memory and s/step against this host's measured peaks (CPU) or the GPU
table's (``device=cuda``; the card is ``$RLHF_GPU``, default H100). :func:`cost_problems` refuses a config whose
predicted memory exceeds a rank's share, naming the knob that frees the most.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rlhf_ops.config import RunConfig, derive_batch_plan
from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.cost_model import (
    CPU_EFFICIENCY,
    GIB,
    GPU_EFFICIENCY,
    ModelShapes,
    Peaks,
    Precision,
    Prediction,
    RolloutMemory,
    StepShape,
    gpu_peaks,
    gpu_rollout_fits,
    memory_terms,
    resident_between_updates,
    stage_seconds,
)
from rlhf_ops.host_peaks import host_peaks
from rlhf_ops.models.resolve import BUILTIN_SMOLLM2, BUILTIN_TINY, BUILTIN_TINY_VLM, cache_dir

_LOG = logging.getLogger(__name__)

GPU_ENV = "RLHF_GPU"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Where rlhf_ops.models.resolve builds each built-in model under its cache folder.
_BUILTIN_DIRS = {BUILTIN_TINY: "tiny-llama", BUILTIN_TINY_VLM: "tiny-vlm", BUILTIN_SMOLLM2: "smollm2-135m-instruct"}


def model_shapes(path: str) -> ModelShapes | None:
    """The shapes in ``path``'s ``config.json`` (a built-in model's once it is built); None when not readable."""
    if path in _BUILTIN_DIRS:
        folder = cache_dir() / _BUILTIN_DIRS[path]
    else:
        folder = Path(path)
    try:
        return ModelShapes.from_config(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def step_shape(config: RunConfig, *, prompt_len: float | None = None, response_len: float | None = None) -> StepShape:
    """One rank's step: its share of the prompts, the expected lengths (default: the maxima), the micro-batches."""
    plan = derive_batch_plan(config)
    actor = plan.actor
    dp = max(actor.mesh.dp_size, 1)
    return StepShape(
        prompts=max(1, -(-plan.prompts_per_step // dp)),
        samples=plan.rollout_n,
        prompt_len=float(prompt_len if prompt_len is not None else plan.max_prompt_length),
        response_len=float(response_len if response_len is not None else plan.max_response_length),
        max_seq_len=plan.max_seq_len,
        update_micro_batch=actor.micro_batch_size_per_rank,
        log_prob_micro_batch=actor.log_prob_micro_batch_size_per_rank,
        optimizer_steps=actor.num_mini_batches * actor.ppo_epochs,
        remove_padding=config.actor.use_remove_padding,
        share_prompt=config.actor.share_prompt_prefix and config.actor.use_remove_padding,
        max_micro_tokens=float(actor.max_token_len_per_rank) if actor.use_dynamic_bsz else None,
    )


def _uses_reference(config: RunConfig) -> bool:
    return config.algorithm.use_kl_loss or config.algorithm.use_kl_in_reward


def _compute_bytes(config: RunConfig, role: str) -> int:
    fsdp = config.actor.fsdp if role == "actor" else config.ref.fsdp
    return _BYTES.get(str(fsdp.mixed_precision.param_dtype or config.model.dtype), 4)


def peaks_for(config: RunConfig, *, measure: bool = True) -> Peaks | None:
    """The device's peaks: this host's (cached, measured on a miss when ``measure``) or the GPU table's."""
    if config.resources.device == "cuda":
        return gpu_peaks(os.environ.get(GPU_ENV, "H100"))
    threads = config.resources.threads_per_worker
    found = host_peaks(threads, measure=measure)
    if found is None:
        return None
    compute = _compute_bytes(config, "actor")
    rollout = _BYTES.get(str(config.rollout.dtype), 4)
    return Peaks(
        name=f"this host ({threads} threads)",
        flops=found["bfloat16" if compute == 2 else "float32"],
        rollout_flops=found["bfloat16" if rollout == 2 else "float32"],
        fp32_flops=found["float32"],
        bandwidth=found["bandwidth"],
        memory_bytes=found["memory_bytes"],
        measured=True,
    )


def predict(
    config: RunConfig,
    *,
    peaks: Peaks,
    shapes: ModelShapes,
    prompt_len: float | None = None,
    response_len: float | None = None,
) -> Prediction:
    """Per-rank memory and s/step of ``config`` on ``peaks`` (lengths default to the config's maxima)."""
    plan = derive_batch_plan(config)
    step = step_shape(config, prompt_len=prompt_len, response_len=response_len)
    fsdp = config.actor.fsdp
    precision = Precision(
        compute_bytes=_compute_bytes(config, "actor"),
        ref_bytes=_compute_bytes(config, "ref") if config.resources.device == "cuda" else 4,
        shard=plan.actor.mesh.shard_size,
        plain_single_rank=fsdp.single_rank_plain and plan.world_size == 1,
        param_offload=fsdp.param_offload and config.resources.device == "cuda",
        optimizer_offload=fsdp.optimizer_offload and config.resources.device == "cuda",
        activation_checkpointing=fsdp.activation_checkpointing,
        lora_rank=config.model.lora.rank,
        use_reference=_uses_reference(config) and config.model.lora.rank == 0,  # LoRA: the base is the reference
    )
    rollout = RolloutMemory(
        engine=config.rollout.engine,
        device=config.resources.device,
        dtype_bytes=_BYTES.get(str(config.rollout.dtype), 4),
        kv_cache_bytes=config.rollout.kv_cache_memory_bytes,
        gpu_memory_utilization=config.rollout.gpu_memory_utilization,
    )
    seconds = stage_seconds(
        shapes,
        step,
        peaks,
        CPU_EFFICIENCY if peaks.measured else GPU_EFFICIENCY,
        rollout_dtype_bytes=rollout.dtype_bytes,
        # The trainer's rule (rlhf_ops.trainer.ppo_trainer.needs_old_log_prob): on-policy updates skip the pass.
        old_log_prob=config.algorithm.use_kl_in_reward or not plan.actor.on_policy,
        use_reference=_uses_reference(config),
        activation_checkpointing=fsdp.activation_checkpointing,
        lora=config.model.lora.rank > 0,
    )
    ranks = config.resources.nproc_per_node if config.resources.device == "cpu" else 1
    prediction = Prediction(
        memory=memory_terms(shapes, step, precision, rollout), seconds=seconds, peaks=peaks, ranks_per_memory=ranks
    )
    budget = config.trainer.early_stop.max_time_s
    if budget is not None and prediction.step_seconds > 0:
        fit = int(budget // prediction.step_seconds)
        prediction.notes.append(
            f"trainer.early_stop.max_time_s={budget:g}: about {fit} step{'s' if fit != 1 else ''} fit (predicted; "
            "start-up and checkpoints not counted)"
        )
    return prediction


# The knob that frees each term, by device.
_KNOBS_CPU = {
    "activations": "lower actor.ppo_micro_batch_size_per_gpu or set actor.fsdp.activation_checkpointing=true",
    "logits": "lower actor.ppo_micro_batch_size_per_gpu",
    "rollout": "lower rollout.kv_cache_memory_bytes (vLLM) or rollout.n",
    "optimizer": "set model.lora.rank (train adapters only) or lower resources.nproc_per_node",
    "grads": "set model.lora.rank (train adapters only) or lower resources.nproc_per_node",
    "params": "lower resources.nproc_per_node (ranks per host) or use a smaller model",
    "compute_copy": "drop actor.fsdp.single_rank_plain or compute in float32",
    "reference": "lower resources.nproc_per_node or set model.lora.rank (the base is the reference)",
    "runtime": "lower resources.nproc_per_node",
}
_KNOBS_GPU = {
    **_KNOBS_CPU,
    "optimizer": "set actor.fsdp.optimizer_offload=true or add GPUs (resources.nproc_per_node)",
    "grads": "add GPUs (resources.nproc_per_node) or set model.lora.rank",
    "params": "set actor.fsdp.param_offload=true or add GPUs (resources.nproc_per_node)",
    "reference": "set ref.fsdp.param_offload=true or add GPUs",
}


def memory_problems(config: RunConfig, prediction: Prediction) -> list[ConfigProblem]:
    """One problem when a rank's predicted memory exceeds its share (GPU: also vLLM's share beside training)."""
    budget = prediction.peaks.memory_bytes / max(prediction.ranks_per_memory, 1)
    terms = prediction.memory
    where = "GPU" if config.resources.device == "cuda" else "host RAM"
    found: list[ConfigProblem] = []
    if config.resources.device == "cuda" and config.rollout.engine == "vllm":
        util = config.rollout.gpu_memory_utilization
        if not gpu_rollout_fits(terms, utilization=util, gpu_bytes=prediction.peaks.memory_bytes):
            resident = resident_between_updates(terms) / GIB
            found.append(
                ConfigProblem(
                    "rollout.gpu_memory_utilization",
                    f"vLLM's {util:.2f} of the {prediction.peaks.name}'s {budget / GIB:.0f} GiB does not fit beside "
                    f"the {resident:.1f} GiB training keeps resident (predicted)",
                    f"lower rollout.gpu_memory_utilization to {max(0.05, 1 - resident * GIB / budget - 0.05):.2f} "
                    "or set actor.fsdp.optimizer_offload=true",
                )
            )
    if prediction.memory_bytes <= budget:
        return found
    largest = max(terms, key=lambda k: terms[k])
    knobs = _KNOBS_GPU if config.resources.device == "cuda" else _KNOBS_CPU
    ranks = f" ({prediction.ranks_per_memory} ranks share it)" if prediction.ranks_per_memory > 1 else ""
    return [
        *found,
        ConfigProblem(
            "resources",
            f"predicted {prediction.memory_bytes / GIB:.1f} GiB per rank exceeds the {budget / GIB:.1f} GiB of "
            f"{where} a rank has{ranks}; the largest term is {largest} ({terms[largest] / GIB:.1f} GiB)",
            knobs[largest],
        ),
    ]


def cost_summary(config: RunConfig, *, measure: bool = False) -> tuple[Prediction, list[ConfigProblem]] | None:
    """The prediction of ``config`` and its memory problems; None when the model's config.json is not readable.

    ``measure=False`` uses this host's cached peaks only (pre-flight stays fast; ``rlhf cost`` measures them):
    without them the memory check still runs, against the host's RAM, and the seconds are left out.
    """
    shapes = model_shapes(config.model.path)
    if shapes is None:
        return None
    peaks = peaks_for(config, measure=measure)
    if peaks is None:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        peaks = Peaks(name="this host", flops=1.0, rollout_flops=1.0, bandwidth=1.0, memory_bytes=ram, measured=True)
        prediction = predict(config, peaks=peaks, shapes=shapes)
        prediction = Prediction(
            memory=prediction.memory,
            seconds={},
            peaks=peaks,
            ranks_per_memory=prediction.ranks_per_memory,
            notes=["s/step: this host's peaks are not measured yet (`rlhf cost` measures them)"],
        )
    else:
        prediction = predict(config, peaks=peaks, shapes=shapes)
    return prediction, memory_problems(config, prediction)


def cost_problems(config: RunConfig) -> list[ConfigProblem]:
    """Pre-flight's cost check: logs the prediction, returns a problem when a rank's memory does not fit."""
    try:
        found = cost_summary(config)
    except ValueError as exc:  # a plan the trainer itself refuses (it says why, with the key): no prediction
        _LOG.info("preflight: no cost prediction (%s)", exc)
        return []
    if found is None:
        return []
    prediction, problems = found
    _LOG.info("preflight: %s", prediction.summary())
    return problems
