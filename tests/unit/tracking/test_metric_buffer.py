"""``MetricBuffer`` with a transport the test controls: a server that is up, away, or refuses a batch.

The real-server cases (an ``mlflow server`` SIGKILLed and started again) are in
``tests/reliability/test_mlflow_outage.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rlhf_ops.tracking.metric_buffer import MetricBuffer


class Server:
    """What the buffer's ``send`` / ``probe`` talk to: stores batches while ``up``, refuses values named 'bad'."""

    def __init__(self) -> None:
        self.up = True
        self.received: list[object] = []
        self.calls = 0
        self.lock = threading.Lock()

    def send(self, batch: list[object]) -> None:
        with self.lock:
            self.calls += 1
            if not self.up:
                raise ConnectionError("Connection refused")
            if "bad" in batch:
                raise PermissionError("400 INVALID_PARAMETER_VALUE")
            self.received.extend(batch)

    def probe(self) -> bool:
        return self.up


def _buffer(server: Server, **kwargs: object) -> MetricBuffer:
    return MetricBuffer(
        server.send,
        where="test server",
        probe=server.probe,
        is_permanent=lambda exc: isinstance(exc, PermissionError),
        max_backoff_s=0.05,
        **kwargs,  # type: ignore[arg-type]
    )


def test_values_are_sent_before_add_returns_while_the_server_answers() -> None:
    server = Server()
    buf = _buffer(server, batch_size=2)
    for step in range(1, 4):
        buf.add([f"a{step}", f"b{step}", f"c{step}"], step=step)
        assert server.received[-3:] == [f"a{step}", f"b{step}", f"c{step}"]  # 3 values: 2 batches, both sent
    report = buf.close(timeout_s=1)
    assert (report.added, report.sent, report.unsent, report.outages) == (9, 9, 0, 0)


def test_outage_buffers_in_order_without_blocking_and_sends_everything_when_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = Server()
    buf = _buffer(server)
    buf.add(["s1"], step=1)
    server.up = False
    start = time.monotonic()
    for step in range(2, 7):
        buf.add([f"s{step}"], step=step)
    assert time.monotonic() - start < 2.0  # training does not wait for a server that is away
    assert buf.report().outages == 1 and buf.backlog == 5 and server.received == ["s1"]
    server.up = True
    assert buf.flush(timeout_s=5)
    assert server.received == [f"s{s}" for s in range(1, 7)]  # in order, each once
    report = buf.close(timeout_s=1)
    assert (report.sent, report.unsent, report.dropped, report.outages, report.max_backlog) == (6, 0, 0, 1, 5)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("test server is not answering (no answer to the health probe)" in m for m in messages) == 1
    assert (
        sum(
            "test server answers again after" in m and "sending the 5 buffered metric values (steps 2-6)" in m
            for m in messages
        )
        == 1
    )


def test_a_full_buffer_drops_the_oldest_values_and_close_reports_what_was_never_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = Server()
    buf = _buffer(server, max_values=4)
    server.up = False
    for step in range(1, 5):
        buf.add([f"x{step}", f"y{step}"], step=step)  # 8 values into 4 places: steps 1-2 dropped
    report = buf.close(timeout_s=0.3)
    assert (report.added, report.sent, report.dropped, report.unsent) == (8, 0, 4, 4)
    assert report.lost_steps == (1, 2, 3, 4)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("metric buffer full (4 values); dropping the oldest, starting with step 1" in m for m in messages)
    assert any("4 metric values of steps 3-4 were not sent" in m for m in messages), messages
    assert any("0 sent, 4 dropped (buffer full), 0 refused, 4 unsent; 1 outage(s)" in m for m in messages)
    with pytest.raises(ValueError, match="is closed; create a new logger"):
        buf.add(["late"], step=5)


def test_a_refused_batch_is_dropped_with_an_error_and_the_rest_still_goes(caplog: pytest.LogCaptureFixture) -> None:
    server = Server()
    buf = _buffer(server, batch_size=1)
    buf.add(["ok1"], step=1)
    buf.add(["bad"], step=2)
    buf.add(["ok3"], step=3)
    report = buf.close(timeout_s=1)
    assert server.received == ["ok1", "ok3"]
    assert (report.sent, report.rejected, report.lost_steps, report.outages) == (2, 1, (2,), 0)
    assert any(
        "test server refused 1 metric values of step 2; they are dropped: 400 INVALID_PARAMETER_VALUE"
        in r.getMessage()
        for r in caplog.records
    )


def test_a_send_that_hangs_stops_add_waiting_after_wait_s() -> None:
    release = threading.Event()
    received: list[object] = []

    def slow_send(batch: list[object]) -> None:
        release.wait(10)
        received.extend(batch)

    buf = MetricBuffer(slow_send, where="slow server", wait_s=0.2)
    start = time.monotonic()
    buf.add(["a"], step=1)  # waits 0.2 s, then gives up waiting
    buf.add(["b"], step=2)  # stalled: does not wait at all
    assert time.monotonic() - start < 1.0
    release.set()
    assert buf.close(timeout_s=5).sent == 2 and received == ["a", "b"]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_values and batch_size must be >= 1"):
        MetricBuffer(lambda batch: None, where="x", max_values=0)
