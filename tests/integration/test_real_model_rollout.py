"""The real pretrained model (SmolLM2-135M-Instruct) through FSDP2 and the vLLM CPU engine, end to end.

What a real model adds over the tiny one: bf16 weights on disk (the trainer must still hold fp32), **tied
embeddings** (``lm_head.weight`` is ``model.embed_tokens.weight``; vLLM's in-place reload left the tied head
stale after every update until the sharding manager sent the alias), **pad == eos** (id 2, also inside the
chat-templated prompt), GQA (9 query / 3 kv heads) and a 49,152-token vocabulary.

One child process (this file run as a script; one vLLM engine per process) builds the policy with the
project's loader on a 1-rank gloo group (fp32), the vLLM engine on the same directory (fp32), and the HF
engine on the FSDP module; it runs: greedy and sampled rollouts before and after one Adam step, each after
a sync, plus a rollout with a second EOS id. The tests assert on the saved results. Prompts are 3
chat-templated questions (the last one with its answer begun), R = 10.
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

from tests.integration.test_vllm_rollout import teacher_forced_log_probs, to_plain
from tests.support.real_model import smollm2_path
from tests.support.rollout_calls import Call, generate
from tests.support.vllm_child import SKIP_EXIT, run_child

# 84 s here (child 70 s: 2 s load, 10 s engine start, 2 syncs, 5 rollouts, 1 step); ~3 min under load.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EOS = PAD = 2
R = 10
QUESTIONS = ["What is 2 + 3?", "Name a colour.", "Is the sky blue? Answer yes or no."]
PREFILL = "Yes."
DIFF_TOL = 1e-4  # |p_rollout - p_actor| in fp32 (the bound for training/rollout_probs_diff_*)


# --------------------------------------------------------------------------------------------- child process
def _prompts(tokenizer: Any, **settings: Any) -> Call:
    """The chat-templated questions, the last one with its answer already begun ("Yes."): its likely next
    token is the EOS, so at least one response ends inside R (a free answer may not)."""
    from rlhf_ops.data.dataset import PromptDataset, encode_prompt

    ids = [encode_prompt([{"role": "user", "content": q}], tokenizer, apply_chat_template=True) for q in QUESTIONS]
    ids[-1] = ids[-1] + tokenizer(PREFILL, add_special_tokens=False)["input_ids"]
    data = PromptDataset(ids, list(QUESTIONS), [""] * len(ids), ["real"] * len(ids))
    batch = data.batch(list(range(len(ids))), pad_token_id=PAD, uid_prefix="q")
    return Call(batch, settings)


def _child_main(model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure (missing build, ABI) means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from rlhf_ops.config.schema import FSDPConfig, RolloutConfig
    from workers.fsdp.mesh import build_device_mesh
    from workers.fsdp.wrap import build_fsdp_model
    from workers.rollout.hf_rollout import HFRollout
    from workers.rollout.sharding_manager import FSDPShardingManager
    from workers.rollout.vllm_rollout import VLLMRollout

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    res: dict[str, Any] = {}
    start = time.perf_counter()
    model = build_fsdp_model(model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu")
    res["load_s"] = time.perf_counter() - start
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        disk = f.get_tensor("model.embed_tokens.weight")
        res["disk_keys_have_lm_head"] = "lm_head.weight" in f.keys()  # noqa: SIM118 - safe_open has no __contains__
    embed = model.get_parameter("model.embed_tokens.weight").full_tensor()
    res["disk_dtype"] = str(disk.dtype)
    res["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    res["embed_equals_disk"] = bool(torch.equal(embed, disk.float()))
    res["tied"] = model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = RolloutConfig(engine="vllm", max_new_tokens=R, kv_cache_memory_bytes=64 << 20, dtype="float32")
    greedy = _prompts(tokenizer, do_sample=False)
    start = time.perf_counter()
    engine = VLLMRollout(
        model_dir, config=config, pad_token_id=PAD, eos_token_id=EOS, seed=0, device="cpu", max_prompt_length=64
    )
    res["engine_start_s"] = time.perf_counter() - start
    hf = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=0)
    manager = FSDPShardingManager(model, engine, bucket_bytes=64 << 20, device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    sampled = _prompts(tokenizer, n=2, temperature=1.0)
    for step in range(2):
        with manager:
            res[f"greedy{step}"] = to_plain(generate(engine, greedy))
            res[f"sampled{step}"] = to_plain(generate(engine, sampled))
        res[f"sync{step}"] = dict(manager.last_metrics)
        res[f"tf_greedy{step}"], res[f"tf_top2_greedy{step}"] = _teacher_forced_top2(model, res[f"greedy{step}"])
        res[f"tf_sampled{step}"] = teacher_forced_log_probs(model, res[f"sampled{step}"])
        if step == 0:  # one Adam step on the sampled responses' NLL: every weight moves by ~lr = 1e-4
            out = res["sampled0"]
            loss = -(_log_probs_with_grad(model, out) * out["response_mask"]).sum() / out["response_mask"].sum()
            loss.backward()
            optimizer.step()
            manager.mark_dirty()  # as the worker does after every update
            optimizer.zero_grad()
            res["tf_sampled0_after_step"] = teacher_forced_log_probs(model, out)
    res["hf_greedy1"] = to_plain(generate(hf, greedy))
    # A second EOS id (as a generation_config.json may list): greedy row 0's first token stops it there.
    second = int(res["greedy1"]["responses"][0, 0])
    res["second_eos"] = second
    two_eos = _prompts(tokenizer, do_sample=False, eos_token_id=[EOS, second])
    with manager:
        res["v_two_eos"] = to_plain(generate(engine, two_eos))
    res["hf_two_eos"] = to_plain(generate(hf, two_eos))
    torch.save(res, out_path)
    engine.shutdown()  # vLLM's teardown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def _log_probs_with_grad(model: torch.nn.Module, out: dict[str, Any]) -> torch.Tensor:
    prompt_len = out["prompts"].shape[1]
    logits = model(
        input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
    ).logits[:, prompt_len - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def _teacher_forced_top2(model: torch.nn.Module, out: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The actor's log-probs of the response tokens (B, R), and its argmax token at each position with the
    margin over the runner-up (B, R each), from one forward."""
    prompt_len = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits[:, prompt_len - 1 : -1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top = log_probs.topk(2, dim=-1)
    chosen = log_probs.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    return chosen, {"argmax": top.indices[..., 0], "margin": top.values[..., 0] - top.values[..., 1]}


# --------------------------------------------------------------------------------------------- fixture
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir = smollm2_path()
    out_path = tmp_path_factory.mktemp("real_vllm") / "results.pt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    start = time.perf_counter()
    proc = run_child(__file__, [model_dir, str(out_path)], env=env, timeout=540)
    res: dict[str, Any] = torch.load(out_path, weights_only=True)
    res["log"] = proc.stdout + proc.stderr
    print(
        f"\n[real vllm] child wall {time.perf_counter() - start:.1f}s | load {res['load_s']:.1f}s | engine start "
        f"{res['engine_start_s']:.1f}s | sync after step {res['sync1']['timing_s/update_weights']:.2f}s"
    )
    return res


def _probs_diff(res: dict[str, Any], key: str) -> dict[str, float]:
    from rlhf_ops.trainer.metrics import compute_rollout_probs_diff

    out = res[key]
    return compute_rollout_probs_diff(out["rollout_log_probs"], res[f"tf_{key}"], out["response_mask"])


# --------------------------------------------------------------------------------------------- tests
def test_bf16_checkpoint_loads_as_fp32_master_weights_with_tied_head(real: dict[str, Any]) -> None:
    assert real["disk_dtype"] == "torch.bfloat16" and not real["disk_keys_have_lm_head"]
    assert real["param_dtypes"] == ["torch.float32"]
    assert real["embed_equals_disk"]  # bf16 -> fp32 is exact: the loader does not depend on the on-disk dtype
    assert real["tied"]  # through meta-init, FSDP2 and the rank-0 broadcast


@pytest.mark.parametrize("step", [0, 1])
def test_rollout_equals_actor_after_each_sync(real: dict[str, Any], step: int) -> None:
    # Step 0: the checkpoint's weights; step 1: after one Adam step and a sync (the tied head included).
    assert real[f"sync{step}"]["weight_sync/skipped"] == 0.0
    for kind in ("greedy", "sampled"):
        metrics = _probs_diff(real, f"{kind}{step}")
        assert metrics["training/rollout_probs_diff_max"] < DIFF_TOL, (kind, metrics)
        assert metrics["training/rollout_probs_diff_mean"] < DIFF_TOL, (kind, metrics)
    # Greedy: every vLLM token is the actor's argmax wherever the top-2 margin exceeds fp32 noise.
    out, top = real[f"greedy{step}"], real[f"tf_top2_greedy{step}"]
    clear = out["response_mask"].bool() & (top["margin"] > 1e-3)
    assert clear.sum() >= 0.9 * out["response_mask"].sum()
    assert torch.equal(out["responses"][clear], top["argmax"][clear])
    if step == 1:  # and the HF engine on the FSDP module generates the same tokens
        assert torch.equal(out["responses"], real["hf_greedy1"]["responses"])


def test_the_step_moved_the_policy_so_a_stale_engine_would_be_caught(real: dict[str, Any]) -> None:
    # The same sampled tokens score differently after the step, by far more than DIFF_TOL: a sync that
    # missed any tensor (the tied head before the fix: diffs ~1e-2) fails the test above.
    mask = real["sampled0"]["response_mask"].bool()
    moved = (real["tf_sampled0_after_step"] - real["tf_sampled0"]).abs()[mask]
    assert moved.max() > 100 * DIFF_TOL
    assert "ParallelLMHead: Failed to load weights" not in real["log"]


def test_pad_equals_eos_keeps_the_ending_eos_in_the_mask(real: dict[str, Any]) -> None:
    out = real["greedy1"]
    ended = [i for i in range(out["responses"].shape[0]) if (out["responses"][i] == EOS).any()]
    assert ended, "no greedy answer ended within R tokens; pick shorter questions"
    for i in ended:
        row, mask = out["responses"][i], out["response_mask"][i]
        first = int((row == EOS).nonzero()[0])
        assert mask[: first + 1].eq(1).all() and mask[first + 1 :].eq(0).all()  # the EOS itself is a response token
        assert row[first + 1 :].eq(PAD).all()
        prompt_len = out["prompts"].shape[1]
        assert out["attention_mask"][i, prompt_len:].tolist() == mask.tolist()


def test_every_eos_id_stops_generation_in_both_engines(real: dict[str, Any]) -> None:
    v, hf, second = real["v_two_eos"], real["hf_two_eos"], real["second_eos"]
    assert second != EOS
    assert torch.equal(v["responses"], hf["responses"]) and torch.equal(v["response_mask"], hf["response_mask"])
    assert v["responses"][0, 0] == second and v["response_mask"][0].tolist() == [1] + [0] * (R - 1)
    assert v["responses"][0, 1:].eq(PAD).all()


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
