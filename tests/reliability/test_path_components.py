"""Names used as path components (experiment, run, data source) never put a file outside their root.

Hostile names go through the config (``trainer.experiment_name`` / ``run_name``: refused, or accepted as one
safe component); every accepted pair is used by the real checkpoint manager under a root, and hostile
``data_source`` values by ``prepare-data``'s reader. Then the whole sandbox is scanned: every file must be under
the root it belongs to.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_ops.checkpoint.manager import CheckpointManager
from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.data.row_text import data_source_problem
from tests.reliability.conftest import Figures
from tests.reliability.test_storage_faults import FileRole, StepState

HOSTILE_NAMES = [
    "../../escaped", "..", ".", "/abs/escaped", "a/../../escaped", "..\\escaped", "x\x00y", "x\ny", " spaced ",
    "~", "~root", "$HOME", "%2e%2e%2fescaped", "a..b", "Ünïcode-run", "-rf", "*", "run?", "C:escaped", "x" * 200,
]  # fmt: skip


def test_hostile_names_write_nothing_outside_their_root(tmp_path: Path, figures: Figures) -> None:
    sandbox = tmp_path / "sandbox"
    root = sandbox / "root"
    root.mkdir(parents=True)
    accepted = refused = 0
    for name in HOSTILE_NAMES:
        quoted = json.dumps(name)  # a YAML double-quoted scalar keeps every character
        try:
            run = load_config("tiny-cpu", [f"trainer.experiment_name={quoted}", f"trainer.run_name={quoted}"])
        except ConfigError as exc:
            refused += 1
            assert {p.key for p in exc.problems} == {"trainer.experiment_name", "trainer.run_name"}
            continue
        accepted += 1
        trainer, role = StepState(), FileRole()
        run_dir = root / run.trainer.experiment_name / run.trainer.run_name
        trainer.step, role.size = 1, 10
        CheckpointManager(run_dir, roles={"actor": role}).save(trainer)
    for source in ["../../etc", "/etc", "a/../../b", "a\\b", "./x", "a//b"]:
        assert data_source_problem(source) is not None, source
    assert data_source_problem("openai/gsm8k") is None
    outside = [p for p in sandbox.rglob("*") if root not in p.parents and p != root]
    assert outside == [], outside
    # Every folder made under the root is exactly <root>/<experiment>/<run>/...: nothing climbed or hid.
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        assert all(part not in ("", ".", "..") and not part.startswith(".") for part in parts[:2]), path
    assert accepted >= 3 and refused >= 10
    figures.record(names=len(HOSTILE_NAMES), names_refused=refused, names_accepted=accepted, files_outside_root=0)
