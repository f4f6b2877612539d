"""``trainer.deterministic``, ``trainer.dump_rollouts`` / ``replay_rollouts`` and ``trainer.early_stop`` on real
``tiny-cpu`` runs: the entrypoint in a subprocess on the session's Ray cluster, as in ``test_checkpoint_resume``.

- two deterministic runs with the same seed: every seed-determined metric and every weight bit-identical;
- a replay of the first run's dump (no rollout): the same losses, rewards and grad norms, bit for bit;
- an early stop at a validation threshold, and one at a spent time budget: exit 0, the stopping step checkpointed,
  the outcome recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.checkpoint.dcp_reader import read_model_state_dict
from rlhf_ops.config import dump_config, load_config
from tests.integration.test_golden_metrics import deterministic

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

RUN_TIMEOUT_S = 300
STEPS = 3
COMMON = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "trainer.logger=[jsonl]",
    "data.toy_rows=256",
]
# What the replay must reproduce: the update's losses and norms, and the rewards it trained on.
REPLAYED = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/advantages/mean",
)


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("preset") / "repro.yaml"
    path.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON])))
    return str(path)


def _train(root: Path, preset: str, ray_address: str, overrides: list[str]) -> tuple[Path, str]:
    """Runs to its end (asserting exit 0); returns the run folder and the driver's output."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, "--ray-address", ray_address]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, f"trainer.checkpoint_root={root}", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "tiny-cpu" / "demo", done.stdout


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_deterministic_runs_are_bit_identical_and_a_replay_of_the_dump_reproduces_the_losses(
    tmp_path: Path, preset: str, ray_address: str
) -> None:
    first, _ = _train(
        tmp_path / "a", preset, ray_address, ["trainer.deterministic=true", "trainer.dump_rollouts=true"]
    )
    second, _ = _train(tmp_path / "b", preset, ray_address, ["trainer.deterministic=true"])
    a, b = _records(first), _records(second)
    assert [r["step"] for r in a] == [1, 2, 3]
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]
    wa = read_model_state_dict(first / f"global_step_{STEPS}" / "actor")
    wb = read_model_state_dict(second / f"global_step_{STEPS}" / "actor")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    dump = first / "rollouts"
    assert sorted(p.name for p in dump.iterdir()) == [
        "manifest.json",
        "step_000001.parquet",
        "step_000002.parquet",
        "step_000003.parquet",
    ]
    replayed, _ = _train(
        tmp_path / "r", preset, ray_address, ["trainer.deterministic=true", f"trainer.replay_rollouts={dump}"]
    )
    r = _records(replayed)
    assert [x["step"] for x in r] == [1, 2, 3]
    for mine, ref in zip(r, a, strict=True):
        for key in REPLAYED:
            assert mine[key] == ref[key], (mine["step"], key, mine[key], ref[key])
    assert "timing_s/gen" not in r[0]  # nothing was generated


def test_an_early_stop_at_a_threshold_ends_the_run_as_a_success_with_its_checkpoint_and_outcome(
    tmp_path: Path, preset: str, ray_address: str
) -> None:
    run_dir, out = _train(
        tmp_path,
        preset,
        ray_address,
        [
            "trainer.test_freq=1",
            "trainer.early_stop.metric=val/reward/mean",
            "trainer.early_stop.threshold=-100",
            "trainer.early_stop.max_time_s=100000",  # a budget that does not end the run: its clock is logged
        ],
    )
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1] and records[0]["training/early_stopped"] == 1.0
    assert 1.0 < records[0]["training/wall_clock_s"] < RUN_TIMEOUT_S  # the driver's start-up and the step
    assert (run_dir / "global_step_1" / "MANIFEST.json").exists()
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["outcome"] == "early_stopped" and outcome["step"] == 1 and outcome["total_steps"] == STEPS
    assert "rlhf: early stop at step 1 of 3: val/reward/mean=" in out


@pytest.mark.slow
def test_a_spent_time_budget_ends_the_run_as_a_success_after_its_first_step(
    tmp_path: Path, preset: str, ray_address: str
) -> None:
    # One second is spent before the first step ends (the driver's start-up counts): the run stops after it.
    run_dir, out = _train(tmp_path, preset, ray_address, ["trainer.early_stop.max_time_s=1"])
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1] and records[0]["training/early_stopped"] == 1.0
    assert records[0]["training/wall_clock_s"] > 1.0
    assert (run_dir / "global_step_1" / "MANIFEST.json").exists()
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["step"] == 1 and outcome["reason"].startswith("wall-clock budget: ")
    assert "rlhf: early stop at step 1 of 3: wall-clock budget: " in out
