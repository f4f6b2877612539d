"""``trainer.deterministic=true``: a run killed (SIGKILL of its whole process group, like a lost node) after its
step-2 checkpoint and started again equals an uninterrupted run bit for bit: every step's seed-determined metrics
(timings, throughput and memory aside) and the final weights.

The runs are the real entrypoint (``python -m workers.entrypoints.train``, ``tiny-cpu``) in a subprocess on the
session's Ray cluster, as in ``test_checkpoint_resume``. 256 prompts / 16 per step: the kill lands mid-epoch, so
the resumed run must also continue the loader's shuffled order from the saved position.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.checkpoint.dcp_reader import read_model_state_dict
from rlhf_ops.config import dump_config, load_config
from rlhf_ops.storage.manifest import read_latest
from tests.integration.test_golden_metrics import deterministic

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

RUN_TIMEOUT_S = 300
STEPS = 4
COMMON = [
    "trainer.deterministic=true",
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.test_freq=2",  # validation at steps 2 and 4: the resumed run's must draw what the other's drew
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "data.toy_rows=256",
]
ENGINES: dict[str, list[str]] = {
    "hf": [],
    "vllm": ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=67108864"],
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


def _lines(run_dir: Path) -> list[str]:
    return [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last record of each step (a step logged just before the kill is logged again by the resumed run)."""
    return {int(r["step"]): r for r in (json.loads(line) for line in _lines(run_dir))}


@pytest.mark.slow  # three runs of the entrypoint (~2-3 min on 2 cores; the vllm case more)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_killed_and_resumed_deterministic_run_equals_an_uninterrupted_one_bit_for_bit(
    tmp_path: Path, tiny_model_dir: str, ray_address: str, engine: str
) -> None:
    preset = tmp_path / "det.yaml"
    overrides = [f"model.path={tiny_model_dir}", *COMMON, *ENGINES[engine]]
    preset.write_text(dump_config(load_config("tiny-cpu", overrides)))
    entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", str(preset), "--ray-address", ray_address]

    def command(root: Path) -> list[str]:
        return [*entry, f"trainer.checkpoint_root={root}"]

    # Uninterrupted.
    (tmp_path / "a").mkdir()
    log_a = tmp_path / "a" / "train.log"
    with log_a.open("wb") as out:
        rc = subprocess.run(
            command(tmp_path / "a"), stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=RUN_TIMEOUT_S
        )
    assert rc.returncode == 0, _tail(log_a)
    ref_dir = tmp_path / "a" / "tiny-cpu" / "demo"

    # Killed after the step-2 checkpoint, then the same command again (resume_mode=auto is the default).
    (tmp_path / "b").mkdir()
    log_b, run_dir = tmp_path / "b" / "train.log", tmp_path / "b" / "tiny-cpu" / "demo"
    with log_b.open("ab") as out:
        proc = subprocess.Popen(
            command(tmp_path / "b"), stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((run_dir / "global_step_2" / "MANIFEST.json").exists() and read_latest(run_dir) == 2):
            assert proc.poll() is None, f"exited ({proc.returncode}) before the step-2 checkpoint:\n{_tail(log_b)}"
            assert time.monotonic() < deadline, f"no step-2 checkpoint:\n{_tail(log_b)}"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / f"global_step_{STEPS}").exists(), "the run finished before the kill: nothing was tested"
    logged_before_kill = len(_lines(run_dir))  # 2, or 3 if step 3 finished in the few ms before the kill
    with log_b.open("ab") as out:
        rc = subprocess.run(
            command(tmp_path / "b"), stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=RUN_TIMEOUT_S
        )
    assert rc.returncode == 0, _tail(log_b)
    resumed = [json.loads(line)["step"] for line in _lines(run_dir)[logged_before_kill:]]
    assert resumed == [3, 4], f"the second run did not resume from step 2: it logged steps {resumed}"

    want, got = _by_step(ref_dir), _by_step(run_dir)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1)), (sorted(want), sorted(got))
    compared = 0
    for step in want:
        a, b = deterministic(want[step]), deterministic(got[step])
        assert a.keys() == b.keys(), (step, sorted(a.keys() ^ b.keys()))
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}  # NaN == NaN
        assert not diff, (step, diff)
        compared += len(a)
    assert compared > 40 * STEPS  # losses, rewards, grad norms, lengths, ... not an empty comparison
    assert any(k.startswith("val/") for k in deterministic(got[STEPS])), "no validation after the resume"
    assert len({want[s]["actor/pg_loss"] for s in want}) > 1 or len({want[s]["actor/grad_norm"] for s in want}) > 1

    wa = read_model_state_dict(ref_dir / f"global_step_{STEPS}" / "actor")
    wb = read_model_state_dict(run_dir / f"global_step_{STEPS}" / "actor")
    assert wa.keys() == wb.keys() and wa
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not unequal, unequal
    print(f"{engine}: {compared} metrics over {STEPS} steps and {len(wa)} weight tensors bit-identical")
    w0 = read_model_state_dict(ref_dir / "global_step_2" / "actor")
    assert any(not torch.equal(wa[k], w0[k]) for k in wa), "steps 3-4 changed no weight: nothing was compared"
