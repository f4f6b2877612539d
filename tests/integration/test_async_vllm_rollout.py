"""``rollout.mode=async``: vLLM's AsyncLLM (engine core in its own process) against the sync engine and the actor.

As in ``test_vllm_rollout.py``, vLLM runs in ONE child process (this file as a script): the engines change
process-wide state. The child builds an FSDP2 tiny policy on a 1-rank gloo group, the async engine (its
engine core is a spawned process) and the sync in-process engine on the same checkpoint, and saves:

- greedy rollouts of both engines on the same prompts (the async one submits each row as its own request);
- after one Adam step (lr 1e-2: every weight moves by ~1e-2) and a sync through the sharding manager (64 KiB
  weight files: several files, one reload), the async engine's greedy rollout, the HF engine's on the
  updated FSDP module, and the actor's teacher-forced log-probs of the async engine's responses.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.config.schema import RolloutConfig
from tests.integration.test_vllm_rollout import (
    EOS,
    PAD,
    R,
    assert_same_rollout,
    make_prompts,
    teacher_forced_grad,
    teacher_forced_log_probs,
    to_plain,
)
from tests.support.rollout_calls import generate
from tests.support.vllm_child import SKIP_EXIT, run_child
from workers.rollout.async_vllm_rollout import AsyncVLLMRollout

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WEIGHT_FILE_BYTES = 64 << 10  # the tiny model is 371968 bytes: at least 6 files per sync


def _child_main(model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure (missing build, ABI) means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from workers.rollout.hf_rollout import HFRollout
    from workers.rollout.sharding_manager import FSDPShardingManager
    from workers.rollout.vllm_rollout import VLLMRollout

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = RolloutConfig(engine="vllm", mode="async", max_new_tokens=R, kv_cache_memory_bytes=64 << 20)
    common: dict[str, Any] = {"pad_token_id": PAD, "eos_token_id": EOS, "seed": 0, "device": "cpu"}
    start = time.perf_counter()
    engine = AsyncVLLMRollout(
        model_dir, config=config, max_prompt_length=8, weight_file_bytes=WEIGHT_FILE_BYTES, **common
    )
    res: dict[str, Any] = {"async_start_s": time.perf_counter() - start, "engine_pid": os.getpid()}
    sync_engine = VLLMRollout(model_dir, config=config, max_prompt_length=8, **common)
    greedy = make_prompts(do_sample=False)
    start = time.perf_counter()
    res["a_greedy0"] = to_plain(generate(engine, greedy))
    res["async_generate_s"] = time.perf_counter() - start
    res["s_greedy0"] = to_plain(generate(sync_engine, greedy))

    manager = FSDPShardingManager(model, engine, bucket_bytes=48 << 10, device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = -(teacher_forced_grad(model, res["a_greedy0"]) * res["a_greedy0"]["response_mask"]).mean()
    loss.backward()
    optimizer.step()
    manager.mark_dirty()  # as the worker does after every update
    optimizer.zero_grad()
    start = time.perf_counter()
    with manager:
        res["sync_s"] = time.perf_counter() - start
        res["a_greedy1"] = to_plain(generate(engine, greedy))
    res["sync1"] = dict(manager.last_metrics)
    res["weight_files"] = engine.last_weight_files
    res["weight_parent"] = str(engine.weight_parent)
    res["weight_dir_left"] = sorted(p.name for p in engine.weight_parent.glob(f"{engine.weight_prefix}*"))
    hf = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R)
    res["hf_greedy1"] = to_plain(generate(hf, greedy))
    res["tf1"] = teacher_forced_log_probs(model, res["a_greedy1"])
    torch.save(res, out_path)
    engine.shutdown()
    sync_engine.shutdown()  # vLLM's in-process teardown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_path = tmp_path_factory.mktemp("vllm-async") / "results.pt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    start = time.perf_counter()
    # ~10 min measured on 2 loaded cores; 480 s timed out once
    run_child(__file__, [tiny_model_dir, str(out_path)], env=env, timeout=1500)
    res: dict[str, Any] = torch.load(out_path, weights_only=True)
    print(
        f"\n[async vllm] child wall {time.perf_counter() - start:.1f}s | async engine start "
        f"{res['async_start_s']:.1f}s"
        f" | first async generate {res['async_generate_s']:.2f}s | sync {res['sync_s'] * 1e3:.0f}ms in "
        f"{res['weight_files']} files"
    )
    return res


@pytest.mark.slow  # two vLLM engines + a spawned engine core: 89 s here (lightly loaded), ~10 min under load
def test_async_greedy_rollout_equals_the_sync_engine(results: dict[str, Any]) -> None:
    a, s = results["a_greedy0"], results["s_greedy0"]
    assert_same_rollout(a, s)  # tokens, masks, positions exactly; log-probs within 1e-4
    assert a["responses"].shape == (3, R) and a["uid"] == ["p0", "p1", "p2"]
    assert (a["rollout_log_probs"][a["response_mask"].bool()] < 0).all()


@pytest.mark.slow  # two vLLM engines + a spawned engine core: 89 s here (lightly loaded), ~10 min under load
def test_weights_reach_the_async_engine_process(results: dict[str, Any]) -> None:
    before, after = results["a_greedy0"], results["a_greedy1"]
    assert_same_rollout(after, results["hf_greedy1"])  # the updated actor, decoded by the HF engine
    mask = after["response_mask"].bool()
    torch.testing.assert_close(after["rollout_log_probs"][mask], results["tf1"][mask], atol=1e-4, rtol=0)
    # The step changed the policy enough to be seen: stale weights in the engine would fail the two checks above.
    assert (before["rollout_log_probs"] - after["rollout_log_probs"]).abs().max() > 1e-2
    assert results["sync1"]["weight_sync/skipped"] == 0.0 and results["sync1"]["weight_sync/num_tensors"] == 21
    assert results["weight_files"] >= 6  # 371968 bytes in files of at most 64 KiB (the largest tensor: 32 KiB)
    assert results["weight_dir_left"] == []  # the update's folder is removed once the engine has loaded it
    assert results["weight_parent"] == ("/dev/shm" if Path("/dev/shm").is_dir() else results["weight_parent"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"config": RolloutConfig(engine="vllm", mode="async", tensor_model_parallel_size=2)}, "set it to 1"),
        ({"weight_file_bytes": 0}, "weight_file_bytes=0 must be >= 1"),
    ],
)
def test_async_rollout_rejects_bad_arguments_before_starting(
    tiny_model_dir: str, overrides: dict[str, Any], match: str
) -> None:
    kwargs: dict[str, Any] = {"config": RolloutConfig(engine="vllm", mode="async"), "pad_token_id": PAD}
    kwargs.update(eos_token_id=EOS, seed=0, device="cpu")
    with pytest.raises(ValueError, match=match):  # raised before vLLM is imported or started
        AsyncVLLMRollout(tiny_model_dir, **{**kwargs, **overrides})


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
