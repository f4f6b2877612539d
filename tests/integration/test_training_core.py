"""The training core on a real local Ray cluster with gloo FSDP2 ranks (issue 3's required tests).

Each test builds real worker groups on the session's Ray cluster; nothing of the project is mocked.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rlhf_ops.config import load_config
from rlhf_ops.padding import compute_position_ids
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from tests.support.training import start_actor_group
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.clients import ActorRolloutRefClient
from workers.single_controller.futures import WorkerGroupError
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker_group import RayWorkerGroup

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

# The rollout's settings (typed, as the controller passes them): temperature-1 sampling of 6 tokens.
SAMPLING = SamplingParams(temperature=1.0, do_sample=True, response_length=6, eos_token_id=2, pad_token_id=0)


def _group(tiny_model_dir: str, world: int, overrides: list[str]) -> tuple[RayResourcePool, RayWorkerGroup]:
    config = load_config("tiny-cpu", [f"resources.nproc_per_node={world}", *overrides])
    return start_actor_group(tiny_model_dir, config, pool_name=f"t{world}")


def _synthetic_batch(num: int, *, prompt_len: int = 5, resp_len: int = 6, seed: int = 0) -> DataProto:
    """A fixed training batch: random tokens, ragged prompts (left pad) and responses (right pad)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, 60, (num, prompt_len), generator=g)
    responses = torch.randint(10, 60, (num, resp_len), generator=g)
    prompt_mask = torch.ones(num, prompt_len, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # every third prompt is 2 tokens shorter
    response_mask = torch.ones(num, resp_len, dtype=torch.long)
    response_mask[1::2, 4:] = 0  # every other response stops after 4 tokens
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
            "advantages": torch.randn(num, resp_len, generator=g),
            "ref_log_prob": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
        }
    )


def test_dp1_and_dp2_give_the_same_update(tiny_model_dir: str) -> None:
    # 16 prompts x n=2 = 32 sequences, one mini-batch of 32 (ppo_mini_batch_size=16 prompts): dp=1 runs
    # 32 per rank in micro-batches of 8 (4 accumulation steps), dp=2 runs 16 per rank (2 steps).
    overrides = ["rollout.n=2", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8"]
    batch = _synthetic_batch(32)
    results = {}
    for world in (1, 2):
        pool, group = _group(tiny_model_dir, world, overrides)
        try:
            results[world] = ActorRolloutRefClient(group).update_actor(batch)
        finally:
            group.shutdown()
            pool.shutdown()
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        torch.testing.assert_close(results[2][key], results[1][key], rtol=1e-5, atol=1e-7, msg=key)
    assert results[1]["actor/grad_norm"] > 0


def test_micro_batch_one_times_four_equals_four_times_one(tiny_model_dir: str) -> None:
    # One rank, one mini-batch of 4 sequences: micro 1 x 4 accumulation steps vs micro 4 x 1.
    common = ["rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"]
    batch = _synthetic_batch(4, seed=1)
    results = {}
    for micro in (1, 4):
        pool, group = _group(tiny_model_dir, 1, [*common, f"actor.ppo_micro_batch_size_per_gpu={micro}"])
        try:
            results[micro] = ActorRolloutRefClient(group).update_actor(batch)
        finally:
            group.shutdown()
            pool.shutdown()
    for key in ("actor/pg_loss", "actor/grad_norm"):
        torch.testing.assert_close(results[1][key], results[4][key], rtol=1e-5, atol=1e-7, msg=key)


def _prompts(num: int) -> DataProto:
    ids = torch.tensor([[1, 5, 19, 31, 32, 41, 71, 69, 13, 70, 6]]).repeat(num, 1)
    ids[:, 8] = torch.arange(num) % 10 + 7  # a different digit token per row
    mask = torch.ones_like(ids)
    mask[::2, 0] = 0  # ragged: every other prompt has one left pad
    ids[::2, 0] = 0
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)})


def test_rollout_log_probs_equal_the_actor_recompute(tiny_model_dir: str) -> None:
    pool, group = _group(tiny_model_dir, 2, [])
    try:
        client = ActorRolloutRefClient(group)
        out = client.generate_sequences(_prompts(6), SAMPLING)  # 6 rows over 2 ranks
        old = client.compute_log_prob(out, temperature=1.0).batch["old_log_probs"]  # its own stage
    finally:
        group.shutdown()
        pool.shutdown()
    mask = out.batch["response_mask"].bool()
    assert out.batch["responses"].shape == (6, 6) and mask.any()
    diff = (out.batch["rollout_log_probs"] - old)[mask].abs().max().item()
    assert diff <= 1e-5, diff


def test_a_dead_worker_fails_the_step_naming_role_and_rank(tiny_model_dir: str) -> None:
    pool, group = _group(tiny_model_dir, 2, [])
    pids = group.call(ActorRolloutRefWorker.get_pid)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerGroupError) as info:
        ActorRolloutRefClient(group).generate_sequences(_prompts(4), SAMPLING)
    assert info.value.role == "actor_rollout_ref" and info.value.rank == 1
    assert group.closed
    pool.shutdown()
    deadline = time.monotonic() + 30
    alive = list(pids)
    while alive and time.monotonic() < deadline:  # no orphan: rank 0 (blocked in a collective) is killed too
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.5)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
