"""The Ray workers' environment: threads per worker, the in-process vLLM engine, bounded oneDNN caches."""

from __future__ import annotations

import pytest

from rlhf_ops.config.loader import load_config
from workers.entrypoints.train import worker_env


def test_workers_get_their_threads_and_bounded_onednn_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    env = worker_env(load_config("tiny-cpu", ["resources.num_cpus_per_worker=2"]))
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # bf16 matmuls would otherwise keep 1,024 + 1,024 oneDNN primitives, one per packed-row shape
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64" and env["LRU_CACHE_CAPACITY"] == "64"


def test_the_drivers_own_onednn_cache_sizes_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    env = worker_env(load_config("tiny-cpu"))
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024" and env["LRU_CACHE_CAPACITY"] == "8"


def test_ranks_get_the_grace_period_and_only_they_take_sigterm_as_a_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import threading

    from workers.preemption import GRACE_ENV, install_rank_handler

    env = worker_env(load_config("tiny-cpu", ["trainer.preemption_grace_s=45"]))
    assert env[GRACE_ENV] == "45"  # a SIGTERM to a rank of a training run is the run's notice
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv(GRACE_ENV, raising=False)
    assert install_rank_handler("rank 0 of W on node n") is False  # any other Ray worker: Ray's default kept
    monkeypatch.setenv(GRACE_ENV, "45")
    installed: list[bool] = []
    thread = threading.Thread(target=lambda: installed.append(install_rank_handler("rank 0 of W on node n")))
    thread.start()
    thread.join()
    assert installed == [False]  # off the main thread a handler cannot be set: nothing changes
    assert signal.getsignal(signal.SIGTERM) is before
