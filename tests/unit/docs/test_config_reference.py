"""docs/reference/config.md is generated from the run config's schema and fails this test when it is stale."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_matches_the_schema() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_leaf_key_of_the_schema_has_a_row() -> None:
    gen = _generator()
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    for key in (
        "actor.optim.lr",
        "algorithm.kl_ctrl.kl_coef",
        "rollout.multi_turn.enable",
        "trainer.remote_store_url",
    ):
        assert f"| `{key}` |" in page, key
    schema = gen.current_schema()
    assert page.count("\n## `") == len(schema["properties"])


def test_a_schema_change_makes_the_page_stale() -> None:
    """A changed description (what a new or edited field does) changes the rendering, so --check would fail."""
    gen = _generator()
    schema = gen.current_schema()
    changed = copy.deepcopy(schema)
    lr = changed["$defs"]["OptimConfig"]["properties"]["lr"]
    lr["description"] = "A different description."
    assert gen.render(changed) != gen.render(schema)
    assert "| `actor.optim.lr` | number" in gen.render(schema)
    assert "A different description." in gen.render(changed)
