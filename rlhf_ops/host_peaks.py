"""This host's matmul peaks (fp32, bf16) and memory bandwidth, measured once (about 1 s) and cached per host.

The measurement runs in a child process (``python -m rlhf_ops.host_peaks``) so that the caller, pre-flight on
an Airflow worker say, never imports torch. The cache is a JSON file under ``$RLHF_CACHE_DIR`` (default
``~/.cache/rlhf_ops``), keyed by host name, CPU model and thread count; delete it to measure again.

The matmul shape is the SmolLM2 MLP's (1024 tokens x 576 x 1536): a small model's real GEMMs run well below a
large square matmul's peak, and the cost model predicts those.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

THREADS_ENV = "OMP_NUM_THREADS"


def _cache_file() -> Path:
    root = Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf_ops"))
    return root / "host_peaks.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_key(threads: int) -> str:
    """The cache key: host name, CPU model, threads."""
    return f"{platform.node()}|{_cpu_model()}|{threads}"


def cached_peaks(threads: int) -> dict[str, float] | None:
    """The cached peaks of this host at ``threads`` threads, or None when never measured."""
    path = _cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(host_key(threads))
    return entry if isinstance(entry, dict) else None


def host_peaks(threads: int, *, measure: bool = True) -> dict[str, float] | None:
    """``{"float32", "bfloat16": FLOP/s, "bandwidth": bytes/s, "memory_bytes"}`` of this host at ``threads``.

    Cached; on a miss (and ``measure``) a child process measures them (~1 s plus torch's import).
    None: not cached and not measured, or the child failed.
    """
    found = cached_peaks(threads)
    if found is not None or not measure:
        return found
    env = dict(os.environ, **{THREADS_ENV: str(threads)})
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_ops.host_peaks"], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode:
        return None
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[host_key(threads)] = peaks
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return dict(peaks)


def measure(threads: int, *, seconds: float = 0.3) -> dict[str, float]:
    """Best GFLOP/s of the MLP-shaped matmul in fp32 and bf16, copy bandwidth of a 256 MiB buffer, host RAM."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(1024, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        a @ b  # warm-up: oneDNN picks and packs its kernel
        best = 0.0
        for _ in range(3):
            reps, start = 0, time.perf_counter()
            while reps == 0 or time.perf_counter() - start < seconds / 3:
                a @ b
                reps += 1
            best = max(best, 2 * 1024 * 576 * 1536 * reps / (time.perf_counter() - start))
        out[name] = best
    src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_bw = 0.0
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best_bw = max(best_bw, 2 * src.numel() * 4 / (time.perf_counter() - start))  # read + write
    out["bandwidth"] = best_bw
    out["memory_bytes"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    out["threads"] = threads
    return out


if __name__ == "__main__":
    print(json.dumps(measure(int(os.environ.get(THREADS_ENV, "1")))))
