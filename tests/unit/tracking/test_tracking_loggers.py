"""ConsoleLogger, JsonlLogger, MultiLogger and metric value conversion."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_ops.tracking import artifacts
from rlhf_ops.tracking.logger import (
    ConsoleLogger,
    JsonlLogger,
    MetricLogger,
    MultiLogger,
    order_metrics,
    table_payload,
    to_float,
    to_float_metrics,
)


def test_to_float_converts_tensors_and_numpy_scalars() -> None:
    assert to_float(torch.tensor(0.25), key="a") == 0.25
    assert to_float(torch.tensor([3]), key="a") == 3.0  # one element is a scalar
    assert to_float(np.float32(0.5), key="a") == 0.5
    assert to_float(np.int64(7), key="a") == 7.0
    assert to_float(True, key="a") == 1.0
    assert math.isnan(to_float(float("nan"), key="a"))


def test_to_float_rejects_non_scalars_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"metric 'actor/kl': expected a scalar, got shape \(2,\)"):
        to_float(torch.tensor([1.0, 2.0]), key="actor/kl")
    with pytest.raises(ValueError, match=r"metric 'x': expected a scalar"):
        to_float(np.zeros(3), key="x")
    with pytest.raises(ValueError, match=r"metric 'name': expected a number, got str"):
        to_float("0.1", key="name")
    with pytest.raises(ValueError, match="expected a number, got NoneType"):
        to_float(None, key="n")


@pytest.mark.parametrize("step", [-1, 1.0, True])
def test_step_must_be_a_non_negative_int(step: object) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        to_float_metrics({"a": 1.0}, step)  # type: ignore[arg-type]


def test_order_metrics_key_metrics_first_then_sorted() -> None:
    metrics = {"z": 1.0, "actor/pg_loss": 2.0, "a": 3.0, "critic/score/mean": 4.0}
    assert [k for k, _ in order_metrics(metrics)] == ["critic/score/mean", "actor/pg_loss", "a", "z"]


def test_console_logger_one_compact_line_per_step() -> None:
    out = io.StringIO()
    logger = ConsoleLogger(out, max_metrics=3)
    logger.log_metrics(
        {
            "timing_s/gen": 1.23456,
            "actor/pg_loss": torch.tensor(-0.0123),
            "critic/score/mean": np.float64(0.5),
            "b": 2,
        },
        step=12,
    )
    # Key metrics first (score, pg_loss), then "b" < "timing_s/gen" alphabetically; 3 shown, 1 counted.
    assert out.getvalue() == "step 12 | critic/score/mean=0.5 actor/pg_loss=-0.0123 b=2 (+1 more)\n"
    logger.log_params({"a": {"b": 1, "c": 2}})
    logger.log_table([{"x": 1}, {"x": 2}], "t.json")
    assert out.getvalue().splitlines()[1:] == ["params | 2 keys", "artifact | t.json (2 rows)"]


def test_jsonl_logger_appends_one_strict_json_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log_metrics({"actor/pg_loss": torch.tensor(0.5), "bad": float("nan"), "big": float("-inf")}, step=1)
    logger.close()
    logger = JsonlLogger(path)  # a resumed run appends
    logger.log_metrics({"actor/pg_loss": 0.25}, step=2)
    logger.close()
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # json.loads would accept NaN; check the text too
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    assert [(r["step"], r["actor/pg_loss"]) for r in records] == [(1, 0.5), (2, 0.25)]
    assert records[0]["bad"] is None and records[0]["big"] is None


def test_jsonl_logger_params_and_artifacts(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path / "m.jsonl")
    logger.log_params({"a": {"b": 1}})
    logger.log_params({"c": "x"})  # merged into the same params.json
    logger.log_dict({"k": [1, 2]}, "config/c.yaml")
    logger.log_table([{"p": "a", "s": 1}], "gen/t.json")
    logger.log_table([{"p": "b", "r": 2}], "gen/t.json")  # appends, like MLflow's log_table
    art = tmp_path / "m_artifacts"
    assert json.loads((art / "params.json").read_text()) == {"a.b": "1", "c": "x"}
    assert (art / "config/c.yaml").read_text() == "k:\n- 1\n- 2\n"
    assert json.loads((art / "gen/t.json").read_text()) == {
        "columns": ["p", "s", "r"],
        "data": [["a", 1, None], ["b", None, 2]],
    }
    with pytest.raises(ValueError, match="escapes the artifact folder"):
        logger.log_text("x", "../outside.txt")
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        logger.log_metrics({"a": 1.0}, step=0)


def test_table_payload_columns_in_first_seen_order() -> None:
    assert table_payload([{"b": 1}, {"a": 2, "b": 3}]) == {"columns": ["b", "a"], "data": [[1, None], [3, 2]]}


class _Failing:
    def __init__(self) -> None:
        self.calls = 0

    def log_metrics(self, metrics: object, step: int) -> None:
        self.calls += 1
        raise ConnectionError("tracking server down")

    def log_params(self, params: object) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, d: object, artifact_file: str) -> None: ...
    def log_table(self, rows: object, artifact_file: str) -> None: ...
    def close(self) -> None: ...


def test_multi_logger_reaches_every_logger_then_raises(tmp_path: Path) -> None:
    failing, out = _Failing(), io.StringIO()
    jsonl = JsonlLogger(tmp_path / "m.jsonl")
    multi = MultiLogger([failing, ConsoleLogger(out), jsonl])
    assert all(isinstance(lg, MetricLogger) for lg in multi.loggers)
    with pytest.raises(ConnectionError, match="server down"):
        multi.log_metrics({"a": 1.0}, step=3)
    multi.close()
    assert failing.calls == 1
    assert out.getvalue() == "step 3 | a=1\n"
    assert json.loads((tmp_path / "m.jsonl").read_text())["a"] == 1.0


def test_artifact_helpers_write_the_documented_layout(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path / "m.jsonl")
    artifacts.log_resolved_config(logger, {"storage": {"password": "pw", "url": "s3://u:p@h/b"}})
    artifacts.log_data_manifest(logger, {"rows": 10})
    assert artifacts.log_rejected_sample(logger, [{"i": i, "reason": "too long"} for i in range(5)], max_rows=2) == 2
    artifacts.log_eval_report(logger, {"acc": 0.5}, step=7)
    artifacts.log_generations(logger, [{"prompt": "1+1", "response": "2", "score": 1.0}], step=7)
    art = tmp_path / "m_artifacts"
    assert (art / "config/resolved_config.yaml").read_text() == (
        "storage:\n  password: '***REDACTED***'\n  url: s3://u:***@h/b\n"
    )
    assert (art / "data/rejected_sample.jsonl").read_text().splitlines() == [
        '{"i": 0, "reason": "too long"}',
        '{"i": 1, "reason": "too long"}',
    ]
    assert json.loads((art / "eval/report_step_000007.json").read_text()) == {"acc": 0.5}
    assert json.loads((art / "generations/step_000007.json").read_text())["columns"] == ["prompt", "response", "score"]
    assert json.loads((art / "data/manifest.json").read_text()) == {"rows": 10}
