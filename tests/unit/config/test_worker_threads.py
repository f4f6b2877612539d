"""resources.num_cpus_per_worker sets each worker's intra-op threads (whole CPUs, at least 1)."""

from __future__ import annotations

import pytest

from rlhf_ops.config import load_config


@pytest.mark.parametrize(("cpus", "threads"), [("0.5", 1), ("1", 1), ("1.5", 1), ("2", 2), ("8", 8)])
def test_threads_per_worker_is_the_floor_of_the_cpu_request(cpus: str, threads: int) -> None:
    config = load_config("tiny-cpu", [f"resources.num_cpus_per_worker={cpus}"])
    assert config.resources.threads_per_worker == threads
