"""``bench/bench_rollout_modes.py --agent-loop``: the per-mode summary of its step rows, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_rollout_modes.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_rollout_modes", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(step: int, seconds: float, samples: int, model: int, everything: int, calls: float) -> dict[str, float]:
    return {
        "step": step,
        "seconds": seconds,
        "samples": samples,
        "model_tokens": model,
        "all_tokens": everything,
        "turns": 2.0 + 2.0 * calls,
        "tool_calls": calls,
        "calling_share": min(calls, 1.0),
        "tool_errors": step,
        "truncated": 0.5,
    }


def test_agent_summary_drops_the_warm_up_step_and_weights_by_samples() -> None:
    rows = [
        _row(1, 100.0, 64, 9999, 99999, 9.0),  # engine warm-up: ignored
        _row(2, 10.0, 64, 600, 1000, 0.0),
        _row(3, 30.0, 32, 1000, 1800, 1.0),
    ]
    got = _bench().agent_summary(rows)
    assert got["model_tok_s"] == pytest.approx(1600 / 40)
    assert got["all_tok_s"] == pytest.approx(2800 / 40)
    assert got["s_per_step"] == pytest.approx(20.0)
    assert got["model_tokens_per_sample"] == pytest.approx(1600 / 96)
    assert got["observation_tokens_per_sample"] == pytest.approx((400 + 800) / 96)
    assert got["tool_calls"] == pytest.approx(32 / 96)  # sample-weighted: 64 samples at 0, 32 at 1
    assert got["turns"] == pytest.approx((64 * 2 + 32 * 4) / 96)
    assert got["calling_share"] == pytest.approx(1 / 3)
    assert got["tool_errors"] == 5.0
    assert _bench().agent_summary(rows[:1])["model_tok_s"] == pytest.approx(99.99)  # one step: kept
