"""Pre-flight refuses a config whose predicted memory per rank exceeds the rank's share, naming the knob.

The model is SmolLM2-135M's shape (config.json only): 30 blocks of h=576, I=1536, kv 3 x 64, so backward keeps
4 B x (7*576 + 3*192 + 4*1536 = 10,752) elements = 43,008 B per token per block, 1.29 MB per token over 30 blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_ops.cli import main
from rlhf_ops.config import RunConfig, load_config
from rlhf_ops.cost_check import cost_summary
from rlhf_ops.pipeline.preflight import preflight_problems

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def _config(tmp_path: Path, *overrides: str) -> RunConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    return load_config("tiny-cpu", [f"model.path={model}", "trainer.logger=[console]", *overrides])


# 64 padded rows of 8192 + 8192 tokens per micro-batch: 1,048,576 tokens x 1.29 MB = 1.35 TB of activations,
# more than any host's RAM.
HUGE = [
    "data.max_prompt_length=8192",
    "rollout.max_new_tokens=8192",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "actor.use_remove_padding=false",
]


def test_preflight_refuses_activations_that_cannot_fit(tmp_path: Path) -> None:
    problems = [p for p in preflight_problems(_config(tmp_path, *HUGE)) if p.key == "resources"]
    assert len(problems) == 1
    text = str(problems[0])
    assert "the largest term is activations (1260.0 GiB)" in text  # 4 * 10752 * 1,048,576 * 30 / 2**30
    assert "2 ranks share it" in text
    assert text.endswith(
        "Fix: lower actor.ppo_micro_batch_size_per_gpu or set actor.fsdp.activation_checkpointing=true"
    )


def test_the_knob_it_names_lets_the_config_through(tmp_path: Path) -> None:
    # Also fewer rows: the HF engine's KV cache of tiny-cpu's 8 prompts x 16 samples per rank at 16,384 tokens
    # (2 x 30 x 3 x 64 x 4 B = 46,080 B per token) would be 90 GiB by itself.
    fewer = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2"]
    fixed = [*HUGE[:2], *fewer, "actor.ppo_micro_batch_size_per_gpu=1", "actor.fsdp.activation_checkpointing=true"]
    found = cost_summary(_config(tmp_path, *fixed))
    assert found is not None
    prediction, problems = found
    assert problems == []
    # one row of 16,384 tokens: block inputs 4 * 576 * 16384 * 30 + one block's set 43,008 * 16384 bytes
    assert prediction.memory["activations"] == 4 * 576 * 16384 * 30 + 43008 * 16384
    assert prediction.memory["rollout"] == 46080 * 2 * 16384  # 1 prompt per rank x 2 samples


def test_gpu_vllm_share_is_refused_with_its_knob(tmp_path: Path, capsys: object) -> None:
    # A 7B-class model (Qwen2.5-7B's shapes) on one H100: fp32 masters 30 GB + AdamW 61 GB resident already
    # exceed the 40 GiB vLLM leaves at gpu_memory_utilization=0.5.
    qwen7b = {
        **SMOLLM2,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    model = tmp_path / "qwen.json"
    model.write_text(json.dumps(qwen7b))
    code = main(
        [
            "cost",
            "tiny-cpu",
            "resources.device=cuda",
            "resources.nproc_per_node=1",
            "rollout.engine=vllm",
            "--gpu",
            "h100",
            "--model-config",
            str(model),
        ]
    )
    out = capsys.readouterr()  # type: ignore[attr-defined]
    assert code == 2
    assert "from the H100 table: a prediction" in out.out
    assert "error: rollout.gpu_memory_utilization: vLLM's 0.50 of the H100's 80 GiB" in out.err


def test_cost_says_how_many_steps_a_time_budget_fits(tmp_path: Path, capsys: object) -> None:
    model = tmp_path / "smollm2.json"
    model.write_text(json.dumps(SMOLLM2))
    head = ["cost", "tiny-cpu", "resources.device=cuda", "resources.nproc_per_node=1"]
    tail = ["--gpu", "h100", "--model-config", str(model)]
    assert main([*head, *tail, "--json"]) == 0
    seconds = sum(json.loads(capsys.readouterr().out)["seconds"].values())  # type: ignore[attr-defined]
    budget = 100 * seconds + 1e-6  # a hundred predicted steps, to rounding
    assert main([*head, f"trainer.early_stop.max_time_s={budget!r}", *tail]) == 0
    first = capsys.readouterr().out.splitlines()[0]  # type: ignore[attr-defined]
    assert f"trainer.early_stop.max_time_s={budget:g}: about 100 steps fit (predicted; " in first
