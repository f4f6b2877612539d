"""``bench/learning_vs_trl.py`` must give TRL the rows and the reward the platform trains with."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from rlhf_ops.config import load_config
from rlhf_ops.data.dataset import read_rows

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_trains_on_the_rows_the_platform_reads_for_the_preset(tmp_path: Path) -> None:
    bench = _load("learning_vs_trl")
    rows = [json.loads(line) for line in bench.train_rows(tmp_path / "rows.jsonl").read_text().splitlines()]
    config = load_config(bench.PRESET, [])
    (source,) = config.data.train_files
    platform = read_rows(source, toy_rows=config.data.toy_rows, seed=config.trainer.seed)
    assert len(rows) == len(platform) == 4000
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in platform]
    assert [r["ground_truth"] for r in rows] == [p["reward_model"]["ground_truth"] for p in platform]


def test_trls_reward_is_the_platforms_gsm8k_flexible_score() -> None:
    reward = _load("trl_side").gsm8k_flexible_reward()
    completions = [
        [{"role": "assistant", "content": "She has 3 + 4 = 7 apples, so the answer is 1,204."}],
        [{"role": "assistant", "content": "The answer is 12 apples."}],
        [{"role": "assistant", "content": "I don't know."}],
    ]
    assert reward(completions, ["1204", "13", "0"]) == [1.0, 0.0, 0.0]
