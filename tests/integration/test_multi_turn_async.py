"""The agent loop on the async engine (``rollout.mode=async``: vLLM ``AsyncLLM``, engine core in its own process)
against the agent loop on the HF engine, and its two schedules against each other: same tokens and masks.

On the async engine the loop runs one coroutine per sample (``AgentLoop.arun``: one request per sample and turn,
each sample's next turn submitted as soon as its own observation is in); the same engine also runs the rounds
(``schedule="rounds"``, what the sync engines do). Greedy, so both must give identical tokens, masks, turn and
tool-call counts.

The scripted episode of ``test_multi_turn_vllm.py``: greedy decoding on the tiny model, turns end at any digit
(``eos_token_id`` lists the ten digit ids), and the ``answer_feedback`` grader replies to a wrong answer, so
samples hold observation tokens (mask 0) between model turns. The engines run in one child process (this file
as a script): vLLM changes process-wide state, and the async engine core is spawned from it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.integration.test_multi_turn_vllm import KEYS, R
from tests.support.vllm_child import SKIP_EXIT, run_child

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _child_main(model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    from transformers import AutoModelForCausalLM

    from rlhf_ops.config.multi_turn import MultiTurnConfig
    from rlhf_ops.config.schema import RolloutConfig
    from rlhf_ops.models.tiny import build_tiny_tokenizer
    from tests.support.rollout_calls import sampling_for
    from tests.unit.rollout.test_hf_rollout import PAD, make_prompts
    from workers.rollout.async_vllm_rollout import AsyncVLLMRollout
    from workers.rollout.hf_rollout import HFRollout
    from workers.rollout.multi_turn import MultiTurnRollout

    tokenizer = build_tiny_tokenizer()
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    cfg = MultiTurnConfig(enable=True, interaction="answer_feedback", max_turns=3, max_tool_response_tokens=10)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf = MultiTurnRollout(
        HFRollout(model, pad_token_id=PAD, eos_token_id=digits, response_length=R), cfg, tokenizer=tokenizer
    )
    config = RolloutConfig(engine="vllm", mode="async", max_new_tokens=R, kv_cache_memory_bytes=64 << 20)
    engine = AsyncVLLMRollout(
        model_dir, config=config, pad_token_id=PAD, eos_token_id=digits, seed=0, device="cpu", max_prompt_length=8
    )
    per_sample = MultiTurnRollout(engine, cfg, tokenizer=tokenizer)
    rounds = MultiTurnRollout(engine, cfg, tokenizer=tokenizer, schedule="rounds")
    assert per_sample.per_sample and not rounds.per_sample
    res: dict[str, Any] = {}
    try:
        for name, rollout in (("hf", hf), ("async", per_sample), ("rounds", rounds)):
            prompts = make_prompts()
            prompts.non_tensor_batch["ground_truth"] = np.array(["7", "6", "0"], dtype=object)
            start = time.perf_counter()
            out = rollout.generate_sequences(prompts, sampling_for(rollout, n=1, do_sample=False))
            res[f"{name}_s"] = time.perf_counter() - start
            assert out.batch is not None
            res[name] = {k: out.batch[k].clone() for k in (*KEYS, "tool_call_counts", "rollout_log_probs")}
        torch.save(res, out_path)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_path = tmp_path_factory.mktemp("async-mt") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    run_child(__file__, [tiny_model_dir, str(out_path)], env=env, timeout=900)
    res: dict[str, Any] = torch.load(out_path, weights_only=True)
    print(
        f"\n[multi-turn async] HF {res['hf_s']:.2f}s, async vLLM per sample {res['async_s']:.2f}s, "
        f"in rounds {res['rounds_s']:.2f}s for 3 greedy samples"
    )
    return res


@pytest.mark.slow  # the engine core is spawned (vLLM imported again): minutes on loaded cores
def test_async_engine_agent_loop_equals_the_hf_agent_loop(results: dict[str, Any]) -> None:
    hf, got = results["hf"], results["async"]
    for key in KEYS:
        torch.testing.assert_close(got[key], hf[key], atol=0, rtol=0, msg=key)
    torch.testing.assert_close(got["rollout_log_probs"], hf["rollout_log_probs"], atol=1e-4, rtol=0)
    observation = hf["attention_mask"][:, -R:].bool() & ~hf["response_mask"].bool()
    assert bool(observation.any()), "at least one sample should get the grader's reply (a hole in its mask)"
    assert int(got["num_turns"].max()) >= 3  # prompt, model turn, grader reply (+ model turns)


@pytest.mark.slow  # same child as above
def test_per_sample_coroutines_equal_the_rounds_on_the_async_engine(results: dict[str, Any]) -> None:
    rounds, got = results["rounds"], results["async"]
    for key in (*KEYS, "tool_call_counts"):  # tokens, masks, num_turns, tool_call_counts... exact
        torch.testing.assert_close(got[key], rounds[key], atol=0, rtol=0, msg=key)
    torch.testing.assert_close(got["rollout_log_probs"], rounds["rollout_log_probs"], atol=1e-4, rtol=0)


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
