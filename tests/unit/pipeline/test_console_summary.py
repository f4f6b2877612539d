"""The demo's view: task lines, the training bar, the summary table and the learning-curve PNG."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from rlhf_ops.pipeline.console import PipelineConsole, TrainingBar, progress_line, train_info_from
from rlhf_ops.pipeline.summary import plot_learning_curve, run_summary, summary_lines


@dataclass
class TI:
    task_id: str
    map_index: int = -1
    run_id: str = "manual__1"


def _metrics(path: Path, steps: int) -> None:
    rows = [{"step": s, "critic/score/mean": s / steps} for s in range(1, steps + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_progress_line() -> None:
    assert progress_line(25, 100, 0.4125, 12.3) == "    train [######..................]   25/100  reward 0.412  12 s"
    assert "reward   -  " in progress_line(0, 100, None, 0)


def test_console_prints_start_once_and_end_with_state(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    _metrics(metrics, 10)
    console = PipelineConsole(out, tty=False, train_info=lambda run_id: (metrics, 10))
    console.on_task_instance_running(None, TI("prepare_data"))
    console.on_task_instance_success(None, TI("prepare_data"))
    console.on_task_instance_running(None, TI("train"))
    console.on_task_instance_running(None, TI("train"))  # resumed after deferral: no second line
    console.on_task_instance_success(None, TI("train"))
    console.on_task_instance_running(None, TI("evaluate.evaluate_checkpoint", 1))
    console.on_task_instance_failed(None, TI("evaluate.evaluate_checkpoint", 1), ValueError("boom\nline 2"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "  ▸ prepare_data" and lines[1].startswith("  ✓ prepare_data") and "success" in lines[1]
    assert lines[2] == "  ▸ train"
    assert lines[3] == "    train [########################]   10/10  reward 1.000  0 s"  # the final draw
    assert lines[4].startswith("  ✓ train")
    assert lines[5] == "  ▸ evaluate.evaluate_checkpoint[1]"
    assert "failed" in lines[6] and lines[6].endswith("  boom")
    assert len(lines) == 7
    assert console.ended[("train", -1)][0] == "success"


def test_bar_prints_a_line_per_fifth_when_not_a_terminal(tmp_path: Path) -> None:
    out, metrics = io.StringIO(), tmp_path / "metrics.jsonl"
    bar = TrainingBar(out, metrics=metrics, total=100, tty=False)
    for steps in (10, 20, 39, 40, 100):
        _metrics(metrics, steps)
        bar._draw(final=False)
    bar._draw(final=True)  # nothing new since step 100 was drawn
    drawn = [line.split()[2] for line in out.getvalue().splitlines()]
    assert drawn == ["20/100", "40/100", "100/100"]


def test_train_info_from_xcoms() -> None:
    assert train_info_from(None, {}) is None
    got = train_info_from({"local_run_dir": "/ck/run"}, {"trainer": {"total_training_steps": 30}})
    assert got == (Path("/ck/run/metrics.jsonl"), 30)


def test_summary_table_and_curve(tmp_path: Path) -> None:
    _metrics(tmp_path / "metrics.jsonl", 10)
    reports = {
        5: {"metrics": {"eval/acc": 0.25, "eval/reward/mean": 0.4, "eval/pass_at_4": 0.5}},
        10: {"metrics": {"eval/acc": 0.75, "eval/reward/mean": 0.8}},
    }
    registered = {"best_step": 10, "checkpoint_decisions": [{"candidate": "global_step_10", "outcome": "win"}]}
    summary = run_summary(tmp_path, reports, registered)
    lines = summary_lines(summary)
    # first: mean reward of steps 1..5 = (0.1+...+0.5)/5 = 0.3; last: steps 6..10 = 0.8
    assert lines[0] == "  train reward (mean of 5 steps): 0.300 at step 1 -> 0.800 at step 10"
    assert lines[2].split() == ["5", "0.300", "0.250", "0.400", "0.500"]
    assert lines[3].split() == ["10", "0.800", "0.750", "0.800", "-", "chosen", "(win)"]
    png = plot_learning_curve(summary, tmp_path / "curve.png", title="t")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
