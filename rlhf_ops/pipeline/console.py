"""What a person watching a pipeline run sees: one line per task as it starts and ends, one training bar.

:class:`PipelineConsole` is an Airflow task-instance listener (registered by the demo with the Task SDK's
listener manager; it is a plain object with pluggy markers, so this module imports no Airflow). Each task
prints ``▸ name`` when it first starts and ``✓ name  3.2 s`` (``✗ … first error line``) when it ends; a
deferred or rescheduled task (the Ray job, the checkpoint sensor) resumes silently. While ``train`` runs, a
thread reads the run's ``metrics.jsonl`` and draws one progress bar with the training reward: redrawn in
place on a terminal, a line per fifth of the run otherwise (so a log file stays short).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import pluggy

hookimpl = pluggy.HookimplMarker("airflow")

REWARD_KEY = "critic/score/mean"
TRAIN_TASK = "train"
BAR_WIDTH = 24


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` written so far (a half-written last line is skipped)."""
    rows = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def progress_line(step: int, total: int, reward: float | None, seconds: float) -> str:
    """``  train [#########...............]  38/100  reward 0.412  41 s``."""
    done = round(BAR_WIDTH * step / total) if total else 0
    bar = "#" * done + "." * (BAR_WIDTH - done)
    shown = "  -  " if reward is None else f"{reward:.3f}"
    return f"    train [{bar}] {step:>4}/{total}  reward {shown}  {seconds:.0f} s"


class TrainingBar:
    """Polls ``metrics.jsonl`` and draws the training bar until :meth:`stop`."""

    def __init__(self, out: TextIO, *, metrics: Path, total: int, tty: bool, every_s: float = 1.0) -> None:
        self.out, self.metrics, self.total, self.tty, self.every_s = out, metrics, max(total, 1), tty, every_s
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._printed_fifth, self._last_step = 0, 0
        self._last = ""
        self._thread = threading.Thread(target=self._loop, name="training-bar", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._draw(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._draw(final=False)

    def _draw(self, *, final: bool) -> None:
        rows = read_metrics(self.metrics)
        step = int(rows[-1]["step"]) if rows else 0
        reward = rows[-1].get(REWARD_KEY) if rows else None
        line = progress_line(step, self.total, reward, time.monotonic() - self._start)
        if self.tty:
            if line != self._last or final:
                self.out.write("\r" + line + ("\n" if final else ""))
                self.out.flush()
            self._last = line
            return
        fifth = 5 * step // self.total
        if fifth > self._printed_fifth or (final and step != self._last_step):
            self.out.write(line + "\n")
            self.out.flush()
            self._printed_fifth, self._last_step = fifth, step


class PipelineConsole:
    """Task-instance listener printing the run's progress to ``out`` (see the module docstring).

    Args:
        out: Where lines go (the terminal; everything else goes to the log file).
        tty: Redraw the training bar in place.
        train_info: ``run_id -> (metrics.jsonl path, total steps)`` once ``preflight`` has run, else None.
    """

    def __init__(self, out: TextIO, *, tty: bool, train_info: Callable[[str], tuple[Path, int] | None]) -> None:
        self.out, self.tty, self.train_info = out, tty, train_info
        self.started: dict[tuple[str, int], float] = {}
        self.ended: dict[tuple[str, int], tuple[str, float]] = {}
        self.bar: TrainingBar | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _key(ti: Any) -> tuple[str, int]:
        index = getattr(ti, "map_index", -1)
        return str(ti.task_id), -1 if index is None else int(index)

    @staticmethod
    def _name(key: tuple[str, int]) -> str:
        return key[0] if key[1] < 0 else f"{key[0]}[{key[1]}]"

    def _print(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    @hookimpl
    def on_task_instance_running(self, previous_state: Any, task_instance: Any) -> None:
        key = self._key(task_instance)
        if key in self.started:
            return  # a deferred / rescheduled task resuming
        self.started[key] = time.monotonic()
        self._print(f"  ▸ {self._name(key)}")
        if key[0] == TRAIN_TASK:
            info = self.train_info(str(task_instance.run_id))
            if info is not None:
                self.bar = TrainingBar(self.out, metrics=info[0], total=info[1], tty=self.tty)
                self.bar.start()

    def _end(self, task_instance: Any, state: str, detail: str = "") -> None:
        key = self._key(task_instance)
        seconds = time.monotonic() - self.started.pop(key, time.monotonic())
        if key[0] == TRAIN_TASK and self.bar is not None:
            self.bar.stop()
            self.bar = None
        self.ended[key] = (state, seconds)
        mark = {"success": "✓", "skipped": "-"}.get(state, "✗")
        self._print(f"  {mark} {self._name(key):<34} {state:<8} {seconds:6.1f} s{detail}")

    @hookimpl
    def on_task_instance_success(self, previous_state: Any, task_instance: Any) -> None:
        self._end(task_instance, "success")

    @hookimpl
    def on_task_instance_skipped(self, previous_state: Any, task_instance: Any) -> None:
        self._end(task_instance, "skipped")

    @hookimpl
    def on_task_instance_failed(self, previous_state: Any, task_instance: Any, error: Any) -> None:
        first = str(error).strip().splitlines()[0][:160] if error else ""
        self._end(task_instance, "failed", f"  {first}" if first else "")


def train_info_from(layout: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> tuple[Path, int] | None:
    """``(metrics.jsonl, total steps)`` of a run from ``preflight``'s ``layout`` and ``config`` XComs."""
    if not layout or not config or not layout.get("local_run_dir"):
        return None
    total = int((config.get("trainer") or {}).get("total_training_steps") or 0)
    return Path(layout["local_run_dir"]) / "metrics.jsonl", total
