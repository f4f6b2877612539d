"""The reliability suite's figures: each case records what it measured (``figures.record``).

With ``RLHF_RELIABILITY_OUT=<folder>`` set, every recorded figure is written to ``<folder>/<case>.json``;
``bench/reliability_report.py`` runs the suite with it and prints them. Without it nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest


class Figures:
    """Figures of one test case, written to ``$RLHF_RELIABILITY_OUT/<case>.json`` when that is set."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.values: dict[str, Any] = {}

    def record(self, **values: Any) -> None:
        self.values.update(values)
        out = os.environ.get("RLHF_RELIABILITY_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"{self.case}.json").write_text(json.dumps(self.values, indent=2, sort_keys=True))


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    name = request.node.name.replace("/", "_").replace("[", "-").replace("]", "")
    return Figures(f"{request.module.__name__.rsplit('.', 1)[-1]}.{name}")
