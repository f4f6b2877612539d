"""When the controller loop saves and how it stops (``rlhf_ops.trainer.faults``): time-based checkpoints, a
preemption notice (a real SIGTERM to this process), a resumed run with nothing left to train.

The loop is the real ``PPOTrainer.fit`` over the fake roles of ``test_controller`` (3 steps), with a checkpointer
that records what it was asked to do.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.trainer.faults import (
    EXIT_PREEMPTED,
    NothingLeftToTrain,
    Preempted,
    PreemptionNotice,
    SaveSchedule,
    warn_if_grace_too_short,
)
from tests.unit.trainer.test_controller import _trainer


class RecordingCheckpointer:
    """The trainer's ``Checkpointer``: records saved steps and finishes; resumes the step it is given."""

    def __init__(self, resume_step: int | None = None) -> None:
        self.resume_step, self.saved, self.finished = resume_step, list[int](), 0

    def maybe_resume(self, trainer: Any) -> int | None:
        if self.resume_step is not None:
            trainer.state.global_step = self.resume_step
        return self.resume_step

    def save(self, trainer: Any) -> object:
        self.saved.append(trainer.state.global_step)
        return None

    def finish(self) -> None:
        self.finished += 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_schedule_saves_by_count_by_time_and_at_the_last_step() -> None:
    clock = Clock()
    schedule = SaveSchedule(save_freq=3, save_every_s=10.0, clock=clock)
    clock.now = 4.0
    assert schedule.due(1, is_last=False) is None  # 4 s since the start < 10 s
    clock.now = 10.0
    assert schedule.due(2, is_last=False) == "save_every_s"  # exactly 10 s: due
    schedule.saved(2, started=9.0)
    assert (schedule.last_save_s, schedule.saved_step) == (1.0, 2)
    clock.now = 15.0
    assert schedule.due(3, is_last=False) == "save_freq"  # count first (the interval restarted at 10 s)
    assert schedule.due(4, is_last=False) is None  # 5 s since the last save
    assert schedule.due(5, is_last=True) == "last"
    assert SaveSchedule(save_freq=0, save_every_s=None, clock=clock).due(7, is_last=False) is None


def test_save_every_s_makes_the_loop_save_after_each_step_that_ends_late_enough(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, ["trainer.save_every_s=1e-9"])  # any step ends after that: a save each step
    checkpointer = RecordingCheckpointer()
    trainer.checkpointer = checkpointer
    trainer.fit()
    assert checkpointer.saved == [1, 2, 3] and checkpointer.finished == 1
    trainer, _ = _trainer(tmp_path / "count", ["trainer.save_every_s=3600"])  # never reached: the last step only
    trainer.checkpointer = checkpointer = RecordingCheckpointer()
    trainer.fit()
    assert checkpointer.saved == [3]


class SigtermAt:
    """A logger that sends this process a real SIGTERM when step ``at`` is logged (mid-run, between steps)."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner, self.at = inner, at

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self.inner.log_metrics(metrics, step=step)
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_sigterm_checkpoints_the_step_it_arrived_in_and_raises_preempted(tmp_path: Path) -> None:
    exits: list[int] = []
    notice = PreemptionNotice(60.0, exit_fn=exits.append).install()
    try:
        trainer, actor = _trainer(tmp_path, [])
        trainer.checkpointer = checkpointer = RecordingCheckpointer()
        trainer.preemption = notice
        trainer.logger = SigtermAt(trainer.logger, at=2)
        with pytest.raises(Preempted, match=r"preempted at step 2 of 3: checkpoint of step 2 committed") as info:
            trainer.fit()
    finally:
        notice.uninstall()
    assert info.value.committed_step == 2 and checkpointer.saved == [2] and checkpointer.finished == 1
    assert len(actor.calls_to("generate_sequences")) == 2  # step 3 never started
    assert exits == []  # the hard stop was cancelled: the loop stopped in time


def test_a_notice_right_after_a_save_does_not_save_again(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, ["trainer.save_freq=2"])
    trainer.checkpointer = checkpointer = RecordingCheckpointer()
    trainer.preemption = notice = PreemptionNotice(60.0, exit_fn=lambda code: None)
    trainer.logger = SigtermAt(trainer.logger, at=2)
    notice.install()
    try:
        with pytest.raises(Preempted, match="checkpoint of step 2"):
            trainer.fit()
    finally:
        notice.uninstall()
    assert checkpointer.saved == [2]  # the save_freq save of step 2 is the preemption checkpoint


def test_the_hard_stop_says_it_could_not_checkpoint_and_exits_preempted(capsys: pytest.CaptureFixture[str]) -> None:
    exits: list[int] = []
    notice = PreemptionNotice(0.01, exit_fn=exits.append)
    notice.committed_step = 4
    notice.notify()
    assert notice._timer is not None
    notice._timer.join(5)
    assert exits == [EXIT_PREEMPTED]
    out = capsys.readouterr().out
    assert "rlhf: preempted: could not checkpoint within trainer.preemption_grace_s=0.01 s" in out
    assert "resumes from its last checkpoint (step 4)" in out


def test_a_resumed_run_at_its_last_step_has_nothing_left_to_train(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, [])
    trainer.checkpointer = RecordingCheckpointer(resume_step=3)
    with pytest.raises(NothingLeftToTrain, match="the checkpoint at step 3 already completed all 3 steps"):
        trainer.fit()
    assert actor.calls_to("generate_sequences") == []


def test_a_grace_period_below_a_step_plus_a_save_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    assert not warn_if_grace_too_short(30.0, save_s=5.0, step_s=10.0)
    assert warn_if_grace_too_short(12.0, save_s=5.0, step_s=10.0)
    assert "trainer.preemption_grace_s=12 is below one step (10.0 s) plus one save (5.0 s)" in caplog.text
    assert "set trainer.preemption_grace_s above 16" in caplog.text


def test_a_hard_stop_after_the_checkpoint_says_the_checkpoint_is_committed(capsys: pytest.CaptureFixture[str]) -> None:
    exits: list[int] = []
    notice = PreemptionNotice(0.01, exit_fn=exits.append)
    notice.committed_step, notice.stopping = 2, True
    notice.notify()
    assert notice._timer is not None
    notice._timer.join(5)
    assert exits == [EXIT_PREEMPTED]
    out = capsys.readouterr().out
    assert "rlhf: preempted: grace period over during shutdown; checkpoint step 2 is committed" in out


class RankNoticeAt:
    """A logger that makes the watched poll report a notice received by a rank when step ``at`` is logged, as
    ``workers/preemption.py`` publishes one (the poll finds it at the next safe point; no signal to this process)."""

    def __init__(self, inner: Any, at: int, found: list[tuple[str, float]], age_s: float) -> None:
        self.inner, self.at, self.found, self.age_s = inner, at, found, age_s

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self.inner.log_metrics(metrics, step=step)
        if step == self.at:
            self.found.append(("SIGTERM to rank 1 of W on node 10.0.0.3 (pid 7)", time.time() - self.age_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_notice_a_rank_received_checkpoints_that_step_and_names_the_rank(tmp_path: Path) -> None:
    exits: list[int] = []
    found: list[tuple[str, float]] = []
    notice = PreemptionNotice(60.0, exit_fn=exits.append)
    notice.watch(lambda: found[0] if found else None, interval_s=3600)  # only the loop's own check() finds it
    try:
        trainer, actor = _trainer(tmp_path, [])
        trainer.checkpointer = checkpointer = RecordingCheckpointer()
        trainer.preemption = notice
        trainer.logger = RankNoticeAt(trainer.logger, at=1, found=found, age_s=5.0)
        match = r"step 1 of 3: checkpoint of step 1 committed 5\.\d s after the notice \(SIGTERM to rank 1"
        with pytest.raises(Preempted, match=match):
            trainer.fit()
    finally:
        notice.uninstall()
    assert checkpointer.saved == [1] and len(actor.calls_to("generate_sequences")) == 1
    assert notice._timer is not None
    notice._timer.join(5)
    assert exits == []  # the hard stop was cancelled by uninstall


def test_a_remote_notice_starts_the_hard_stop_when_the_rank_got_it(capsys: pytest.CaptureFixture[str]) -> None:
    # grace 2 s, the rank received it 1.9 s ago: the hard stop is 0.1 s away, not 2 s.
    exits: list[int] = []
    notice = PreemptionNotice(2.0, exit_fn=exits.append)
    notice.watch(lambda: ("SIGTERM to rank 0 of W on node n1 (pid 9)", time.time() - 1.9), interval_s=0.01)
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [EXIT_PREEMPTED] and 1.85 <= notice.elapsed_s() < 3.0
    out = capsys.readouterr().out
    assert "could not checkpoint within trainer.preemption_grace_s=2 s of the notice (SIGTERM to rank 0 of W" in out
    notice.uninstall()


def test_a_poll_that_fails_is_ignored_and_a_second_notice_changes_nothing() -> None:
    notice = PreemptionNotice(60.0, exit_fn=lambda code: None)

    def broken() -> tuple[str, float] | None:
        raise ConnectionError("GCS unreachable")

    notice._polls.append(broken)  # polled by check() only (no watching thread)
    assert notice.check() is False
    notice.notify("first")
    received = notice.received_at
    notice.notify("second", age_s=10.0)
    assert (notice.source, notice.received_at) == ("first", received)
    notice.uninstall()


def test_after_stop_watching_a_rank_notice_is_not_taken() -> None:
    # The run is over: ranks that Ray stops get a SIGTERM as well, which must not become a notice.
    notice = PreemptionNotice(60.0, exit_fn=lambda code: None)
    found: list[tuple[str, float]] = []
    notice.watch(lambda: found[0] if found else None, interval_s=0.01)
    notice.stop_watching()
    found.append(("SIGTERM to rank 0 of W on node n1 (pid 9)", time.time()))
    time.sleep(0.05)  # the watching thread, had it gone on, would have taken it by now
    assert notice.check() is False and not notice.received
    notice.uninstall()
