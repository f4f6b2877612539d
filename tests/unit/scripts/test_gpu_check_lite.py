"""The lite GPU check's CPU dry run as the bare GPU machine runs it: pydantic, Ray, vLLM, MLflow, boto3 absent.

The dry run goes through the same code as the GPU check (FSDP2 with bf16 compute, HF rollout, remove padding,
the update, LoRA) on gloo with tiny shapes, in a subprocess whose import system cannot find the packages the
device machine lacks, so an import of one of them anywhere on the script's path fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Hides the packages from every finder, as on a machine where they are not installed: find_spec and
# importlib.metadata both answer "absent" (transformers and accelerate probe with both).
BLOCKER = """
import importlib.abc, importlib.metadata, runpy, sys
ABSENT = {"pydantic", "pydantic_core", "ray", "vllm", "mlflow", "mlflow_skinny", "boto3", "botocore"}

class Hide(importlib.abc.MetaPathFinder):
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, context=None, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        if find is None:
            return iter(())
        context = context or importlib.metadata.DistributionFinder.Context(**kwargs)
        return (d for d in find(context) if (d.metadata["Name"] or "").lower().replace("-", "_") not in ABSENT)

    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()

sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ABSENT)
print("ABSENT-LOADED", loaded)
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", BLOCKER, str(REPO / "scripts" / "gpu_check_lite.py"), *args]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_dry_run_needs_none_of_the_packages_the_gpu_machine_lacks(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = _run(tmp_path, "--device", "cpu", "--dry-run", "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ABSENT-LOADED []" in proc.stdout
    result = json.loads(out.read_text())
    assert [p["phase"] for p in result["phases"]] == ["full", "lora"]
    assert result["problems"] == []
    full, lora = result["phases"]
    # bf16 compute against the fp32 CPU copy of the same weights: rounding only (a packing or position bug
    # gives whole nats), and the rollout's own log-probs agree with the packed forward's.
    assert full["logp_vs_cpu_ref_max"] < 0.05
    assert full["logp_vs_rollout_max"] < 0.05
    assert full["steps"] == 2 and all(g > 0 for g in full["grad_norm"])
    assert full["liger"] == "off" and lora["lora_rank"] == 16 and lora["update_tokens_per_s"] > 0
    # 4 prompts x 2 samples, prompts of 6..12 tokens and 8 response columns: at most 8 x 20 tokens per step.
    assert 0 < full["update_tokens_per_s"] and full["peak_rss_gb"] > 0


def test_the_blocker_really_hides_a_package(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import pydantic\n")
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "No module named 'pydantic'" in proc.stderr


def test_cuda_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--device", "cuda")
    if "torch sees no CUDA device" not in proc.stderr:  # a CUDA host runs the real check instead
        assert proc.returncode == 0
        return
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
