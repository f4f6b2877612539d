"""Seeded sampling of a batch whose prompts exceed vLLM's per-step token budget, on the CPU build.

vLLM 0.32's CPU runner rewinds a seeded request's generator (``gen.set_offset``) when the request's prefill is
cut into chunks, and a CPU ``torch.Generator`` has no offset: with chunked prefill on, a step whose prompts
hold more than ``max_num_batched_tokens`` (4096 on CPU) tokens raised "RuntimeError: CPU Generator does not use
offset" (seen with multi-turn SmolLM2 contexts: 40 sampled requests of 118-token prompts). ``VLLMRollout`` now
turns chunked prefill off on CPU. Here 12 distinct random prompts of 400 tokens, 2 samples each (9,600 prompt
tokens, no shared prefix) are sampled with per-request seeds, twice with the same step: both calls must finish
and give the same tokens (seeded per row), and the two samples of a prompt must differ somewhere.

Runs in a child process (this file as a script): vLLM changes process-wide state.
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

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROMPTS, PROMPT_LEN, N, R = 12, 400, 2, 8


def _child_main(model_dir: str, out_path: str) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"import vllm failed: {exc!r}", flush=True)
        sys.exit(SKIP_EXIT)
    from rlhf_ops.config.schema import RolloutConfig
    from rlhf_ops.padding import compute_position_ids
    from rlhf_ops.protocol import DataProto
    from tests.support.rollout_calls import sampling_for
    from workers.rollout.vllm_rollout import VLLMRollout

    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 80, (PROMPTS, PROMPT_LEN), generator=gen)  # the tiny vocab is 84; 0-2 special
    attention_mask = torch.ones_like(input_ids)
    position_ids = compute_position_ids(attention_mask)
    prompts = DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    )
    config = RolloutConfig(engine="vllm", max_new_tokens=R, kv_cache_memory_bytes=64 << 20)
    engine = VLLMRollout(
        model_dir, config=config, pad_token_id=0, eos_token_id=2, seed=0, device="cpu", max_prompt_length=PROMPT_LEN
    )
    try:
        sampling = sampling_for(engine, n=N, temperature=1.0, do_sample=True)
        scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
        res: dict[str, Any] = {"chunked": bool(scheduler.enable_chunked_prefill)}
        for name in ("first", "again"):
            out = engine.generate_sequences(prompts, sampling, step=3)
            assert out.batch is not None
            res[name] = out.batch["responses"].clone()
        torch.save(res, out_path)
    finally:
        engine.shutdown()


@pytest.mark.slow  # one engine start (~30-60 s on 2 loaded cores)
def test_seeded_sampling_of_prompts_over_the_step_budget(tiny_model_dir: str, tmp_path: Path) -> None:
    out_path = tmp_path / "results.pt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    run_child(__file__, [tiny_model_dir, str(out_path)], env=env, timeout=600)
    res = torch.load(out_path, weights_only=True)
    print(f"\n[vllm seeded long batch] child {time.perf_counter() - start:.1f} s")
    assert res["chunked"] is False
    assert res["first"].shape == (PROMPTS * N, R)
    torch.testing.assert_close(res["again"], res["first"], atol=0, rtol=0)  # per-row seeds from the step
    pairs = res["first"].view(PROMPTS, N, R)
    assert bool((pairs[:, 0] != pairs[:, 1]).any()), "the two samples of every prompt are identical: not sampled"


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
