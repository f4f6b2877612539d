"""Memory options and hybrid sharding (issue 6): each option ON trains like OFF on a fixed batch.

Every test builds real worker groups on the session's Ray cluster (gloo FSDP2 ranks) and compares the
metric trajectory of 3 ``update_actor`` (``update_critic``) calls on the same batch: 2 mini-batches per
call, so 6 optimizer steps, and each call's losses are computed with the weights the previous calls left.

Tolerances (relative): activation checkpointing, optimizer / parameter offload and HSDP 1e-5 (measured: 0, 0
and 2.9e-7; offload is a no-op on a CPU mesh, see docs/memory.md); bf16 mixed precision ``BF16_RTOL``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.config.schema import FSDPConfig, MixedPrecisionConfig
from rlhf_ops.protocol import DataProto
from tests.unit.workers.fsdp_test_batch import make_ppo_batch
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefSpec, ActorRolloutRefWorker
from workers.actor.forward import response_log_probs
from workers.clients import ActorRolloutRefClient, CriticClient
from workers.critic.critic_worker import CriticSpec, CriticWorker
from workers.fsdp import apply_fsdp2, build_device_mesh, load_hf_model
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker_group import RayWorkerGroup

pytestmark = pytest.mark.integration

# 16 sequences (8 prompts x n=2) per update; mini-batches of 4 prompts x 2 = 8 sequences (2 optimizer steps per
# update), 4 per rank on 2 ranks, micro-batches of 2 (2 accumulation steps). lr / entropy pinned: the preset may move.
COMMON = [
    "rollout.n=2",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "actor.optim.lr=3e-3",
    "algorithm.entropy_coeff=0.01",
    "algorithm.use_kl_loss=true",
]
ACTOR_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy")
CRITIC_KEYS = ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean")
UPDATES = 3
EXACT_RTOL = 1e-5
# bf16 params / fp32 reduce / fp32 logits vs fp32: measured max relative deviation over the 3-update trajectory
# of pg_loss, grad_norm, kl_loss and entropy 4.5e-3; the bound leaves 4x headroom.
BF16_RTOL = 2e-2


def _batch() -> DataProto:
    return make_ppo_batch(batch_size=16, prompt_len=6, response_len=5, seed=5)


def _actor_trajectory(model_dir: str, overrides: list[str], *, world: int = 2) -> list[dict[str, float]]:
    config = load_config("tiny-cpu", [f"resources.nproc_per_node={world}", *COMMON, *overrides])
    spec = ActorRolloutRefSpec(
        role="actor",
        model_path=model_dir,
        model=config.model,
        actor=config.actor,
        ref=config.ref,
        rollout=config.rollout,
        algorithm=config.algorithm,
        plan=derive_batch_plan(config, steps_per_epoch=UPDATES),
        pad_token_id=0,
        eos_token_id=2,
        seed=3,
        device="cpu",
    )
    pool = RayResourcePool([world], use_gpu=False, num_cpus_per_process=0.5, name_prefix="mem")
    group = RayWorkerGroup(pool, ActorRolloutRefWorker, worker_kwargs={"spec": spec}, name_prefix="actor")
    try:
        group.call(ActorRolloutRefWorker.init_model)
        client = ActorRolloutRefClient(group)
        return [client.update_actor(_batch()) for _ in range(UPDATES)]
    finally:
        group.shutdown()
        pool.shutdown()


def _critic_trajectory(model_dir: str, overrides: list[str], *, world: int = 1) -> list[dict[str, float]]:
    config = load_config(
        "tiny-cpu",
        [
            f"resources.nproc_per_node={world}",
            *COMMON,
            "algorithm.adv_estimator=gae",
            "critic.ppo_mini_batch_size=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.optim.lr=3e-3",
            *overrides,
        ],
    )
    plan = derive_batch_plan(config, steps_per_epoch=UPDATES).critic
    assert plan is not None
    spec = CriticSpec(
        model_path=model_dir,
        model=config.model,
        critic=config.critic,
        algorithm=config.algorithm,
        plan=plan,
        seed=3,
        device="cpu",
    )
    pool = RayResourcePool([world], use_gpu=False, num_cpus_per_process=0.5, name_prefix="memc")
    group = RayWorkerGroup(pool, CriticWorker, worker_kwargs={"spec": spec}, name_prefix="critic")
    try:
        group.call(CriticWorker.init_model)
        client = CriticClient(group)
        return [client.update_critic(_batch()) for _ in range(UPDATES)]
    finally:
        group.shutdown()
        pool.shutdown()


def _max_rel_diff(got: list[dict[str, float]], want: list[dict[str, float]], keys: tuple[str, ...]) -> float:
    return max(abs(g[k] - w[k]) / max(abs(w[k]), 1e-12) for g, w in zip(got, want, strict=True) for k in keys)


def _assert_same_trajectory(
    got: list[dict[str, float]], want: list[dict[str, float]], keys: tuple[str, ...], *, rtol: float, label: str
) -> None:
    diff = _max_rel_diff(got, want, keys)
    print(f"{label}: max relative deviation from OFF over {UPDATES} updates = {diff:.2e} (bound {rtol:.0e})")
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in keys:
            torch.testing.assert_close(g[key], w[key], rtol=rtol, atol=1e-8, msg=f"update {step}: {key}")
    # The trajectory moves: the updates changed the weights (else equality would prove nothing).
    assert abs(want[-1][keys[0]] - want[0][keys[0]]) > 1e-4 * max(abs(want[0][keys[0]]), 1e-12)


@pytest.fixture(scope="module")
def actor_off(ray_cluster: None, tiny_model_dir: str) -> list[dict[str, float]]:
    """The OFF trajectory: fp32, no checkpointing, no offload, plain 1-D FSDP over 2 ranks."""
    return _actor_trajectory(tiny_model_dir, [])


@pytest.mark.parametrize(
    ("label", "overrides", "rtol"),
    [
        ("activation checkpointing", ["actor.fsdp.activation_checkpointing=true"], EXACT_RTOL),
        (
            "optimizer + param offload",
            ["actor.fsdp.optimizer_offload=true", "actor.fsdp.param_offload=true"],
            EXACT_RTOL,
        ),
        (
            "bf16 mixed precision",
            ["actor.fsdp.mixed_precision.param_dtype=bfloat16", "actor.fsdp.mixed_precision.reduce_dtype=float32"],
            BF16_RTOL,
        ),
    ],
)
def test_actor_memory_option_keeps_the_loss_trajectory(
    actor_off: list[dict[str, float]], tiny_model_dir: str, label: str, overrides: list[str], rtol: float
) -> None:
    got = _actor_trajectory(tiny_model_dir, overrides)
    _assert_same_trajectory(got, actor_off, ACTOR_KEYS, rtol=rtol, label=label)


def test_hsdp_2x1_mesh_equals_1x2_mesh(actor_off: list[dict[str, float]], tiny_model_dir: str) -> None:
    # 2 ranks as (replicate=2, shard=1): each rank holds full params, grads all-reduced across replicas;
    # OFF is the 1-D mesh of 2 (= 1 x 2: one replica, params sharded over both ranks). Same gradient sum.
    got = _actor_trajectory(tiny_model_dir, ["actor.fsdp.hsdp_replicate_size=2"])
    _assert_same_trajectory(got, actor_off, ACTOR_KEYS, rtol=EXACT_RTOL, label="HSDP 2x1 vs 1x2")


@pytest.mark.usefixtures("ray_cluster")
def test_critic_checkpointing_and_offload_keep_the_value_loss_trajectory(tiny_model_dir: str) -> None:
    off = _critic_trajectory(tiny_model_dir, [])
    on = _critic_trajectory(
        tiny_model_dir,
        [
            "critic.fsdp.activation_checkpointing=true",
            "critic.fsdp.optimizer_offload=true",
            "critic.fsdp.param_offload=true",
        ],
    )
    _assert_same_trajectory(on, off, CRITIC_KEYS, rtol=EXACT_RTOL, label="critic AC + offload")


# --------------------------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A world-size-1 gloo default group (reused if another test module already started one)."""
    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def test_bf16_params_still_give_fp32_log_probs(gloo: None, tiny_model_dir: str) -> None:
    b = _batch().batch
    assert b is not None
    inputs: dict[str, Any] = {
        "input_ids": b["input_ids"],
        "attention_mask": b["attention_mask"],
        "position_ids": b["position_ids"],
        "response_length": b["responses"].shape[-1],
    }
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = load_hf_model(tiny_model_dir, kind="causal_lm", attn_implementation="eager")
        cfg = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=dtype, reduce_dtype="float32"))
        apply_fsdp2(model, build_device_mesh(1), cfg)
        with torch.no_grad():
            raw = model(input_ids=b["input_ids"][:1], use_cache=False).logits
            results[dtype], _ = response_log_probs(model, **inputs)
        assert raw.dtype == getattr(torch, dtype)  # the LM head computes in param_dtype ...
        assert results[dtype].dtype == torch.float32  # ... and the loss path upcasts before the log-softmax
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    mask = b["response_mask"].bool()
    diff = (results["bfloat16"] - results["float32"])[mask].abs().max().item()
    print(f"bf16 vs fp32 token log-prob: max abs diff {diff:.2e}")
    assert 0 < diff < 5e-2  # bf16 has 8 mantissa bits: ~4e-3 relative per op, log-probs near -4.4
