"""Session-wide fixtures: environment for loopback-only Ray/vLLM/MLflow, one Ray cluster per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Before anything imports ray / vllm / airflow: stay on loopback, no telemetry, one thread per op.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests load reward functions from temporary modules of any name; tests/reliability/test_code_policy.py checks
# the allow-list itself (a deployment's default is the built-ins only).
os.environ.setdefault("RLHF_ALLOWED_CODE_MODULES", "*")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the whole session (starting one costs ~10 s on 2 cores).

    Tests that need Ray take this fixture; a test that must own its cluster (the Airflow operator's
    job-submission tests) starts a separate head with ``rlhf_ops.pipeline.local_stack``.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={
                "env_vars": {
                    "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                }
            },
        )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster: None) -> str:
    """The session cluster's GCS address, for runs that attach to it (``rlhf train --ray-address``)."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny Llama, built once per session."""
    from rlhf_ops.models.tiny import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny LLaVA-style VLM and its processor, built once per session."""
    from rlhf_ops.models.tiny_vlm import build_tiny_vlm_dir

    return str(build_tiny_vlm_dir(tmp_path_factory.mktemp("models") / "tiny-vlm"))
