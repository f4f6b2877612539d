"""``rlhf config from-verl``: a verl launch script or YAML becomes a preset here; what cannot come is listed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from rlhf_ops.config import load_config
from rlhf_ops.config.verl_import import convert, script_overrides
from rlhf_ops.verl_migration_doc import migration_markdown

REPO = Path(__file__).parents[3]

# Modelled on verl's examples/grpo_trainer/run_qwen2-7b_math.sh and run_qwen2-7b_math_megatron_trtllm.sh: shell
# variables (one with a default from the first argument), a list built from two of them, line continuations,
# quoted values, Hydra's "+" prefix, the script's "$@", and keys with no counterpart (Megatron, TensorRT-LLM).
VERL_SCRIPT = r"""set -x

TP=${1:-2}
gsm8k_train_path=$HOME/data/gsm8k/train.parquet
math_train_path=$HOME/data/math/train.parquet
gsm8k_test_path=$HOME/data/gsm8k/test.parquet
train_files="['$gsm8k_train_path', '$math_train_path']"
export PROJECT_NAME=${PROJECT_NAME:-"verl_grpo_example_gsm8k_math"}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.val_files=$gsm8k_test_path \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=${TP} \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.max_num_batched_tokens=32768 \
    +actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name="$PROJECT_NAME" \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@ 2>&1 | tee verl_demo.log
"""


def test_script_overrides_expand_variables_and_continuations() -> None:
    overrides, problems = script_overrides(VERL_SCRIPT, {"HOME": "/home/me"})
    assert problems == []
    assert "data.train_files=['/home/me/data/gsm8k/train.parquet', '/home/me/data/math/train.parquet']" in overrides
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" in overrides  # ${1:-2}: no argument given
    assert "trainer.project_name=verl_grpo_example_gsm8k_math" in overrides
    assert overrides[-1] == "trainer.total_epochs=15"  # "$@ 2>&1 | tee" is the shell's, not verl's
    assert len(overrides) == 39


def test_a_verl_script_becomes_a_preset_that_validates(tmp_path: Path) -> None:
    script = tmp_path / "run_qwen2-7b_math.sh"
    script.write_text(VERL_SCRIPT)
    out = tmp_path / "qwen2-7b-math.yaml"
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "config", "from-verl", str(script), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={"HOME": "/home/me", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    # Each key that cannot come over: one line, naming the verl key and why.
    refused = [line for line in proc.stderr.splitlines() if line.startswith("  not carried over: ")]
    assert [line.split(": ")[1] for line in refused] == [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters",
    ]
    assert "Megatron-LM parallelism is not supported here" in refused[0]
    assert "does not validate" not in proc.stderr
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert sum("actor_rollout_ref.rollout.max_num_batched_tokens" in line for line in header) == 1

    run = load_config(out)
    assert run.model.path == "Qwen/Qwen2-7B-Instruct" and run.actor.optim.lr == 1e-6
    assert run.data.train_files == ["/home/me/data/gsm8k/train.parquet", "/home/me/data/math/train.parquet"]
    assert run.data.val_files == ["/home/me/data/gsm8k/test.parquet"] and run.rollout.max_new_tokens == 1024
    assert (run.resources.nproc_per_node, run.resources.nnodes, run.resources.device) == (8, 1, "cuda")
    assert run.rollout.engine == "vllm" and run.rollout.n == 5 and run.rollout.tensor_model_parallel_size == 2
    assert run.algorithm.use_kl_loss and run.algorithm.kl_loss_type == "low_var_kl"
    assert run.actor.fsdp.activation_checkpointing and run.ref.fsdp.param_offload
    assert run.trainer.logger == ["console", "mlflow"] and run.tracking.experiment == "verl_grpo_example_gsm8k_math"
    assert run.reward.reward_fn == "default"  # verl's reward by data_source, named since the script sets none


def test_a_verl_yaml_becomes_a_preset() -> None:
    # An excerpt of verl's ppo_trainer.yaml: interpolations, _target_ and nulls carry no setting.
    verl_yaml = """
actor_rollout_ref:
  model: {path: Qwen/Qwen2.5-0.5B-Instruct, use_remove_padding: true, external_lib: null}
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    strategy: fsdp
    optim: {lr: 1.0e-06, lr_warmup_steps: -1, clip_grad: 0.5, total_training_steps: -1}
    ppo_mini_batch_size: 64
    ppo_micro_batch_size_per_gpu: 8
    use_remove_padding: ${oc.select:actor_rollout_ref.model.use_remove_padding,false}
    fsdp_config: {param_offload: false, model_dtype: fp32, dtype: bfloat16, use_torch_compile: true}
    use_prefix_grouper: true
  rollout:
    name: vllm
    n: 8
    response_length: ${oc.select:data.max_response_length,512}
data: {train_files: ~/data/gsm8k/train.parquet, max_prompt_length: 512, max_response_length: 256}
custom_reward_function: {path: /opt/rewards/gsm8k_reward.py, name: compute_score}
trainer: {n_gpus_per_node: 8, save_freq: -1, default_local_dir: /ckpt, use_legacy_worker_impl: auto}
"""
    conversion = convert(verl_yaml, is_yaml=True, environ={})
    (problem,) = conversion.problems  # torch.compile (verl's default) has no effect here; the prefix grouper is not
    assert str(problem).startswith("actor_rollout_ref.actor.use_prefix_grouper: this verl setting (= True) has no")
    preset = conversion.preset
    assert preset["actor"]["optim"] == {"lr": 1e-6}  # lr_warmup_steps=-1: verl's "not set"
    assert preset["actor"]["grad_clip"] == 0.5 and preset["actor"]["fsdp"]["master_dtype"] == "float32"
    assert preset["actor"]["fsdp"]["mixed_precision"]["param_dtype"] == "bfloat16"
    assert preset["data"]["train_files"] == ["~/data/gsm8k/train.parquet"]
    assert preset["rollout"] == {"engine": "vllm", "n": 8, "max_new_tokens": 256}
    assert preset["reward"]["reward_fn"] == "gsm8k_reward:compute_score"
    assert preset["trainer"] == {"save_freq": 0, "checkpoint_root": "/ckpt"}
    assert yaml.safe_load(yaml.safe_dump(preset)) == preset


def test_the_migration_page_is_generated_from_the_table() -> None:
    page = REPO / "docs" / "verl_migration.md"
    assert page.read_text() == migration_markdown(), "docs are stale: run python scripts/gen_verl_docs.py"
    assert "| `actor_rollout_ref.actor.optim.lr` | `actor.optim.lr` |" in page.read_text()


def test_scripts_that_build_bash_arrays_and_arithmetic_are_read_like_bash() -> None:
    # The layout of verl's newer examples (run_qwen2-32b_sglang_fsdp_npu.sh): settings in arrays, sizes computed.
    script = """
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/datasets/deepscaler/train.parquet"}
max_response_length=$((1024 * 8))
DATA_CONFIG=(
    data.train_files="${TRAIN_FILE}"
    data.max_response_length=${max_response_length}
)
ROLLOUT_CONFIG=( actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.dtype=bf16 )
python3 -m verl.trainer.main_ppo --config-path=config --config-name='ppo_trainer.yaml' \\
    "${DATA_CONFIG[@]}" \\
    "${ROLLOUT_CONFIG[@]}" \\
    trainer.total_epochs=${EPOCHS} \\
    "$@" | tee log.txt
"""
    overrides, problems = script_overrides(script, {"HOME": "/home/me"})
    assert overrides == [
        "data.train_files=/home/me/verl/datasets/deepscaler/train.parquet",
        "data.max_response_length=8192",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.dtype=bf16",
    ]
    (problem,) = problems  # $EPOCHS is set nowhere: named, not guessed
    assert str(problem).startswith("trainer.total_epochs: uses a shell variable the script does not set")


def test_every_native_logger_survives_an_override_and_verl_trackers_become_mlflow() -> None:
    """``trainer.logger`` is a verl key too: its value goes through the verl mapping, which must keep ours."""
    from typing import get_args

    from rlhf_ops.config.section import LoggerName

    native = list(get_args(LoggerName))
    assert load_config("tiny-cpu", [f"trainer.logger=[{','.join(native)}]"]).trainer.logger == native
    assert load_config("tiny-cpu", ["trainer.logger=[jsonl,prometheus]"]).trainer.logger == ["jsonl", "prometheus"]
    assert load_config("tiny-cpu", ["trainer.logger=[console,wandb]"]).trainer.logger == ["console", "mlflow"]
