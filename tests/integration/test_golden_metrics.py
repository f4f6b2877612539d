"""Behaviour pins for refactors (issue 10): fixed-seed 5-step ``tiny-cpu`` runs against recorded metrics.

Each case is the real entrypoint (``python -m workers.entrypoints.train``) in a subprocess on the session's
Ray cluster, as in ``test_checkpoint_resume``; its ``metrics.jsonl`` is compared, step by step, with
``tests/golden/tiny_cpu_5_steps.json`` on every deterministic metric (losses, rewards, KL, grad norms,
log-prob stats; never timings, throughput or memory). A refactor that keeps the computation order gives
the same bits; one that reorders a sum may move the last digits, so the bound is 1e-6 (relative above 1).

Rewrite the golden file (only when a change of numbers is intended, and say why in the commit):
``RLHF_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/integration/test_golden_metrics.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.config import dump_config, load_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_cpu_5_steps.json"
RUN_TIMEOUT_S = 600  # a shared 2-core machine under load: a 5-step vLLM run has taken > 300 s
TOLERANCE = 1e-6
STEPS = 5
COMMON = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "trainer.logger=[console,jsonl]",
    "data.val_files=[]",
    "data.toy_rows=256",
]
# Each case covers a different path of the dataflow; all of them need the old-log-prob stage (2 mini-batches).
CASES: dict[str, list[str]] = {
    # GRPO, KL loss against the reference, HF rollout, fixed micro-batches.
    "hf": [],
    # vLLM rollout with weight sync, remove padding and token-budget (dynamic) micro-batches.
    "vllm": [
        "rollout.engine=vllm",
        "rollout.kv_cache_memory_bytes=67108864",
        "actor.use_remove_padding=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=512",
        "actor.log_prob_max_token_len_per_gpu=1024",
    ],
    # PPO with a critic (GAE) and the KL penalty in the reward.
    "gae": ["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=true"],
    # Multi-turn agent loop (HF engine) with an interaction: observation tokens (mask 0) between model turns.
    "multi_turn": [
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.interaction=answer_feedback",
        "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_tool_response_tokens=40",
        "rollout.max_new_tokens=96",
        "rollout.n=4",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
    ],
}
# Metric families the trainer logs since the golden runs were recorded: the sample ledger's counts
# (rlhf_ops/trainer/sample_ledger.py). They are checked exactly by the fault tests, not here.
_ADDED_SINCE_RECORDING = ("samples/",)
# Wall-clock, throughput and memory figures change from run to run; everything else is a function of the seed.
_VOLATILE_KEYS = {"timestamp"}
_VOLATILE_PREFIXES = ("timing_s/", "perf/", "memory/", "system/")
_VOLATILE_PARTS = ("throughput", "mfu", "memory", "_seconds", "tokens_per_s")


def deterministic(record: dict[str, Any]) -> dict[str, float]:
    """The metrics of one ``metrics.jsonl`` record that a fixed seed determines."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and key not in _VOLATILE_KEYS
        and not key.startswith(_VOLATILE_PREFIXES)
        and not any(part in key for part in _VOLATILE_PARTS)
    }


def _train(root: Path, tiny_model_dir: str, ray_address: str, overrides: list[str]) -> list[dict[str, float]]:
    preset = root / "golden.yaml"
    preset.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON, *overrides])))
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", str(preset), "--ray-address", ray_address]
    cmd.append(f"trainer.checkpoint_root={root}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    log = root / "train.log"
    with log.open("wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S).returncode
    assert rc == 0, f"training exited {rc}; log {log}:\n{log.read_text(errors='replace')[-4000:]}"
    lines = (root / "tiny-cpu" / "demo" / "metrics.jsonl").read_text().splitlines()
    return [deterministic(json.loads(line)) for line in lines if line.strip()]


def _compare(case: str, got: list[dict[str, float]], want: list[dict[str, float]]) -> tuple[float, int, int]:
    """Asserts equal keys and values within the tolerance; returns (worst diff, identical values, all values)."""
    assert len(got) == len(want) == STEPS, (case, len(got), len(want))
    worst, identical, total = 0.0, 0, 0
    for step, (mine, ref) in enumerate(zip(got, want, strict=True), start=1):
        # Metrics added after the recording (new counters, not changed numbers) may appear; none may go missing.
        added = {key for key in set(mine) - set(ref) if key.startswith(_ADDED_SINCE_RECORDING)}
        assert sorted(set(mine) - added) == sorted(ref), (case, step, sorted((set(mine) - added) ^ set(ref)))
        for key, value in ref.items():
            total += 1
            if mine[key] == value or (math.isnan(mine[key]) and math.isnan(value)):
                identical += 1
                continue
            diff = abs(mine[key] - value)
            worst = max(worst, diff)
            assert diff <= TOLERANCE * max(1.0, abs(value)), (case, step, key, mine[key], value)
    return worst, identical, total


@pytest.mark.parametrize(
    "case",
    [
        "hf",
        pytest.param("vllm", marks=pytest.mark.slow),
        pytest.param("gae", marks=pytest.mark.slow),
        pytest.param("multi_turn", marks=pytest.mark.slow),
    ],
)
def test_a_fixed_seed_run_gives_the_recorded_metrics(
    case: str, tmp_path: Path, tiny_model_dir: str, ray_address: str
) -> None:
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    writing = os.environ.get("RLHF_WRITE_GOLDEN") == "1"
    if case not in recorded and not writing:
        pytest.skip(f"no golden run recorded for {case!r}: record it with RLHF_WRITE_GOLDEN=1 (before a refactor)")
    got = _train(tmp_path, tiny_model_dir, ray_address, CASES[case])
    if writing:
        golden = {**recorded, case: {"overrides": [*COMMON, *CASES[case]], "steps": got}}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN.name}[{case!r}]")
    want = recorded[case]
    assert want["overrides"] == [*COMMON, *CASES[case]], "the case changed: rewrite the golden file"
    worst, identical, total = _compare(case, got, want["steps"])
    print(f"{case}: {identical}/{total} values bit-identical, largest difference {worst:.3g}")
    assert any(v != 0.0 for step in got for k, v in step.items() if k == "actor/grad_norm")  # a run that trained
