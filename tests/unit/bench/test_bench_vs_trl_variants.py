"""``bench/bench_vs_trl.py``: every variant is a valid config, and ``--variants auto`` picks per host kind."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rlhf_ops.config.loader import load_config

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_vs_trl.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(_bench().RANK_VARIANTS))
def test_each_variant_resolves_to_a_valid_run_config(name: str, tmp_path: Path) -> None:
    bench = _bench()
    args = argparse.Namespace(steps=3, platform_override=[])
    overrides = bench.platform_overrides("builtin:tiny-llama", tmp_path / "rows.jsonl", args, tmp_path, "r")
    config = load_config("tiny-cpu", [*overrides, *bench.RANK_VARIANTS[name]])
    bf16_rollout = "rollout.dtype=bfloat16" in bench.RANK_VARIANTS[name]
    assert config.rollout.dtype == ("bfloat16" if bf16_rollout else "float32")
    assert config.rollout.engine == "vllm"


def test_auto_variants_exist_and_bf16_only_where_native() -> None:
    bench = _bench()
    for kind, names in bench.AUTO_VARIANTS.items():
        assert names[0] == "1x2-plain", kind  # the fp32 baseline of the reward-curve comparison comes first
        assert set(names) <= set(bench.RANK_VARIANTS), kind
    assert not any("bf16" in n for n in bench.AUTO_VARIANTS["fp32"])
    assert "1x2-bf16-full-mb16" in bench.AUTO_VARIANTS["amx"]
    assert bench.host_kind() in bench.AUTO_VARIANTS
