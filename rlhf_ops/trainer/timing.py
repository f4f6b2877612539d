"""One wall-clock timer per stage of a training step (``timing_s/<stage>``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageTimer:
    """Accumulates seconds per stage; ``metrics()`` returns ``{"timing_s/<stage>": seconds}``."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": s for name, s in self._seconds.items()}
