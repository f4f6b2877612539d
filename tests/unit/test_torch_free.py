"""The torch-free core, stated as a contract: these packages and modules import without torch.

The Airflow side (DAG parsing, pre-flight, the provider's tasks), the CLI's config commands and a user's
machine without a GPU stack import only these. Each entry is imported, with every module under a package,
in a fresh interpreter where ``torch`` (and the other heavy stacks) cannot be imported at all: a
``sys.meta_path`` finder refuses them, so a lazy import that slipped to module level fails here.
A new module under a listed package is in the contract automatically; a heavy one belongs elsewhere
(``rlhf_ops.algorithms``, ``rlhf_ops.trainer``, ``workers``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Every module under these packages.
TORCH_FREE_PACKAGES = frozenset(
    {
        "rlhf_ops.agent",
        "rlhf_ops.config",
        "rlhf_ops.extensions",
        "rlhf_ops.pipeline",
        "rlhf_ops.storage",
        "rlhf_ops.tracking",
    }
)
# Single modules (their packages also hold heavy modules).
TORCH_FREE_MODULES = frozenset(
    {
        "rlhf_ops",
        "rlhf_ops.cli",
        "rlhf_ops.code_policy",
        "rlhf_ops.process_reaper",
        "rlhf_ops.sampling",
        "rlhf_ops.data.prepare",
        "rlhf_ops.data.sources",
        "rlhf_ops.evaluation.evaluator",
        "rlhf_ops.models.resolve",
        "rlhf_ops.models.modality",
        "rlhf_ops.rewards",
        "rlhf_ops.rewards.registry",
    }
)
HEAVY = ("torch", "transformers", "vllm", "sglang", "peft", "ray")

_BLOCK_AND_IMPORT = """
import importlib, pkgutil, sys
heavy = set(sys.argv[2].split(","))

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in heavy:
            raise ImportError(f"{name} is not importable in the torch-free core")
        return None

sys.meta_path.insert(0, Refuse())
root = importlib.import_module(sys.argv[1])
walk = sys.argv[3] == "walk" and hasattr(root, "__path__")
names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")] if walk else []
for name in names:
    importlib.import_module(name)
print(len(names) + 1)
"""


@pytest.mark.parametrize(
    ("target", "walk"),
    [*((p, "walk") for p in sorted(TORCH_FREE_PACKAGES)), *((m, "one") for m in sorted(TORCH_FREE_MODULES))],
)
def test_imports_without_torch(target: str, walk: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT, target, ",".join(HEAVY), walk],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{target} needs a heavy import:\n{result.stderr[-3000:]}"
    assert int(result.stdout.split()[-1]) >= 1


def test_the_blocker_really_blocks() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT, "rlhf_ops.algorithms", ",".join(HEAVY), "one"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "torch is not importable in the torch-free core" in result.stderr
