"""``bench/scaling.py``: shape parsing, the KV cache it sizes, its step summary and its report, by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("scaling", BENCH / "scaling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_shape() -> None:
    scaling = _bench()
    assert scaling.parse_shape("16x8x256") == (16, 8, 256)
    with pytest.raises(SystemExit, match="PxNxT"):
        scaling.parse_shape("16x8")
    with pytest.raises(SystemExit, match="PxNxT"):
        scaling.parse_shape("0x8x32")


def test_kv_cache_holds_every_sequence(tmp_path: Path) -> None:
    scaling = _bench()
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # 2 x 30 layers x 3 heads x 64 dims x 4 bytes = 46,080 bytes per token
    assert scaling.kv_cache_bytes(str(tmp_path), 8, 4, 32) == 256 << 20  # 32 x 96 tokens: the floor
    need = 46_080 * 16 * 8 * (64 + 256) * 1.1  # 2.08e9
    got = scaling.kv_cache_bytes(str(tmp_path), 16, 8, 256)
    assert need <= got < need + (64 << 20) and got % (64 << 20) == 0


def _step(seconds: float, gen: float, resp: float) -> dict[str, float]:
    return {
        "perf/time_per_step": seconds,
        "perf/total_num_tokens": 100 * seconds,
        "prompt_length/mean": 45.0,
        "response_length/mean": resp,
        "perf/cpu_peak_rss_gb": seconds / 10,
        "timing_s/gen": gen,
        "timing_s/worker/generate_sequences": gen - 1,
        "critic/score/mean": 0.5,
    }


def test_summary_skips_the_first_step() -> None:
    scaling = _bench()
    out = scaling.summarize([_step(40.0, 9.0, 30.0), _step(20.0, 5.0, 20.0), _step(12.0, 3.0, 22.0)], seqs=32)
    assert out["s_per_step"] == 16.0  # median of 20 and 12
    assert out["s_min_after_first"] == 12.0
    assert out["step_s_all"] == [40.0, 20.0, 12.0]
    assert out["response_len"] == 21.0
    assert out["peak_rss_gb"] == 4.0  # the largest over every step, the first included
    assert out["stages"] == {"gen": 4.0}  # the workers' own timings are left out


def test_report_rows_ratios_and_linearity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scaling = _bench()

    def row(shape: str, steps: list[float], tokens: float, predicted: float) -> dict[str, object]:
        return {
            "shape": shape,
            "load_before": [1.0, 1.0, 1.0],
            "load_after": [2.0, 1.0, 1.0],
            "platform": {
                "s_per_step": steps[1],
                "step_s_all": steps,
                "tokens_per_step": tokens,
                "peak_rss_gb": 5.0,
                "stages": {"gen": 2.0, "ref": 1.0, "update_actor": 4.0},
            },
            "predicted": {"s_per_step": predicted, "stages": {"update_actor": 3.0}, "peak_rss_gb": 4.0},
            "update_floor": {"gemm_floor_s": 2.0, "micro_tokens": 250, "micro_batches": 4, "attention_gflop": 50.0},
        }

    (tmp_path / "a.json").write_text(json.dumps({"rows": [row("8x4x32", [15.0, 10.0, 10.0], 2000.0, 8.0)]}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": [row("16x8x256", [60.0, 50.0, 40.0], 10000.0, 45.0)]}))
    scaling.report([tmp_path / "a.json", tmp_path / "b.json"])
    out = capsys.readouterr().out
    assert "| 8x4x32 (a) | 2000 | 10.0 (gen 2.0, ref 1.0, update_actor 4.0)" in out
    assert "8.0 (0.80) | 4.00 (0.80)" in out
    assert "| 8x4x32 (a) | update_actor | 3.00 | 4.00 | 0.75 |" in out
    assert "| 8x4x32 (a) | 4.00 | 2.00 | 2.0x | 250 x 4 | 50 |" in out
    # tokens x5; median 50 / 10 = x5 (linear); quietest after the first 40 / 10 = x4
    assert "16x8x256 (b): tokens x5.00; median s/step x5.00 (1.00 of linear)" in out
    assert "quietest step after the first x4.00 (0.80)" in out
