"""verl's key names on the command line and in YAML: carried to the keys here, or refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_ops.config import ConfigError, dump_config, load_config
from rlhf_ops.config.verl_compat import lookup, native_field
from rlhf_ops.config.verl_keys import VERL_KEYS, Carry, Drop

REPO = Path(__file__).parents[3]


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_verl_overrides_land_on_the_keys_here_and_show_under_their_names() -> None:
    run = load_config(
        "tiny-cpu",
        [
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.model.path=builtin:tiny-llama",
            "trainer.n_gpus_per_node=4",
            "trainer.nnodes=2",
            "data.max_response_length=24",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.adv_estimator=rloo",
            "algorithm.kl_ctrl.kl_coef=0.02",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.actor.entropy_coeff=0.001",
            "actor_rollout_ref.actor.clip_ratio=0.28",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "critic.optim.lr=2e-5",
            "reward_model.micro_batch_size_per_gpu=4",
            "custom_reward_function.path=/home/me/rewards/my_reward.py",
            "custom_reward_function.name=score_it",
            "trainer.save_freq=-1",  # verl's "never": 0 (only at the end) here
            "+trainer.project_name=gsm8k",  # Hydra's append prefix
            "trainer.critic_warmup=0",  # accepted, no effect: this platform's behaviour
            "actor_rollout_ref.actor.strategy=fsdp",
        ],
    )
    assert run.actor.optim.lr == 3e-6 and run.model.path == "builtin:tiny-llama"
    assert (run.resources.nproc_per_node, run.resources.nnodes) == (4, 2)
    assert run.rollout.max_new_tokens == 24 and run.rollout.n == 4 and run.rollout.gpu_memory_utilization == 0.6
    assert run.algorithm.adv_estimator == "rloo" and run.algorithm.kl_ctrl.kl_coef == 0.02
    assert run.algorithm.use_kl_loss and run.algorithm.kl_loss_coef == 0.01 and run.algorithm.entropy_coeff == 0.001
    assert run.algorithm.clip_ratio_low == run.algorithm.clip_ratio_high == 0.28
    assert (run.actor.ppo_mini_batch_size, run.actor.ppo_micro_batch_size_per_gpu) == (8, 2)
    assert run.actor.log_prob_micro_batch_size_per_gpu == 16 and run.ref.fsdp.param_offload
    assert run.critic.optim.lr == 2e-5 and run.reward.micro_batch_size_per_gpu == 4
    assert run.reward.reward_fn == "my_reward:score_it"
    assert run.trainer.save_freq == 0 and run.tracking.experiment == "gsm8k"
    shown = dump_config(run)
    assert "actor_rollout_ref" not in shown and "n_gpus_per_node" not in shown and "nproc_per_node: 4" in shown


def test_a_preset_yaml_may_hold_verl_sections(tmp_path: Path) -> None:
    preset = yaml.safe_load((REPO / "rlhf_ops/config/presets/tiny-cpu.yaml").read_text())
    preset["actor_rollout_ref"] = {
        "actor": {"optim": {"lr": 5.0e-6, "_target_": "verl.workers.config.FSDPOptimizerConfig"}, "ppo_epochs": 2},
        "rollout": {"name": "hf", "n": 4, "engine_kwargs": {"vllm": {}, "sglang": {}}, "max_model_len": None},
        "model": {"use_remove_padding": "${oc.select:actor_rollout_ref.model.use_remove_padding,false}"},
    }
    preset["trainer"]["n_gpus_per_node"] = 2
    preset.get("actor", {}).get("optim", {}).pop("lr", None)  # set by verl's section only
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(preset))
    run = load_config(path)
    assert run.actor.optim.lr == 5e-6 and run.algorithm.ppo_epochs == 2
    assert run.rollout.n == preset["rollout"]["n"] != 4  # the key here wins over verl's for the same setting
    assert run.rollout.engine == "hf" and run.resources.nproc_per_node == 2


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("actor_rollout_ref.actor.strategy=megatron", "Megatron-LM parallelism is not supported here"),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4", "(the closest setting here: actor.fsdp)"),
        ("actor_rollout_ref.rollout.name=trtllm", "TensorRT-LLM rollout is not supported here"),
        ("actor_rollout_ref.rollout.max_num_batched_tokens=8192", "vLLM engine tuning is not exposed here"),
        ("trainer.device=npu", "Ascend NPUs are not supported here"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=nonexistent", "set a value algorithm.policy_loss accepts"),
        ("actor_rollout_ref.actor.optim.lr=-1", "set a value actor.optim.lr accepts"),
        ("custom_reward_function.name=my_fn", "set custom_reward_function.path"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "(the closest setting here: actor.optim.lr_w"),
    ],
)
def test_keys_and_values_with_no_counterpart_are_refused_naming_the_verl_key(override: str, says: str) -> None:
    key = override.partition("=")[0]
    problems = _problems([override])
    assert list(problems) == [key] and says in problems[key] and "\n" not in problems[key]


def test_a_misspelt_verl_key_is_refused_with_the_close_one() -> None:
    problems = _problems(["actor_rollout_ref.rollout.gpu_memory_utilisation=0.5"])
    message = problems["actor_rollout_ref.rollout.gpu_memory_utilisation"]
    assert "did you mean actor_rollout_ref.rollout.gpu_memory_utilization?" in message
    problems = _problems(["custom_reward_function.paht=/x.py"])
    assert "not a verl key with a counterpart here" in problems["custom_reward_function.paht"]


def test_every_refused_key_is_reported_at_once_on_the_command_line() -> None:
    cmd = [
        sys.executable,
        "-m",
        "rlhf_ops.cli",
        "config",
        "show",
        "tiny-cpu",
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.rollout.name=trtllm",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip().startswith("- ")]
    assert len(lines) == 2, proc.stderr
    assert lines[0].strip().startswith("- actor_rollout_ref.actor.strategy:") and "actor.fsdp" in lines[0]


def test_the_table_names_only_keys_that_exist_here() -> None:
    for key, entry in VERL_KEYS.items():
        natives = entry.natives if isinstance(entry, Carry) else (entry.native,) if entry.native else ()
        for native in natives:
            # A Drop may point at a section (reward, actor.fsdp) or a role's Ulysses size that only the actor has.
            ok = native_field(native) is not None or native.endswith("ulysses_sequence_parallel_size")
            assert ok, f"{key} -> {native}"
        if isinstance(entry, Drop):
            assert entry.reason and not entry.reason.endswith(".")
    assert (
        lookup("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size")
        is VERL_KEYS["actor_rollout_ref.actor.megatron.*"]
    )
