"""FSDP2 / HSDP over 2 gloo ranks (torch.multiprocessing, no Ray): dp=2 equals dp=1; meta-init load is exact.

One spawn runs every check (starting 2 processes that import torch + transformers costs ~10 s on 2 cores);
rank 0 writes the numbers to a file and the tests below assert on them.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

pytestmark = pytest.mark.integration

WORLD = 2
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forward(model: nn.Module, data: Any) -> torch.Tensor:
    b = data.batch
    with torch.no_grad():
        return model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits


def _actor(model: nn.Module, plan: Any, group: dist.ProcessGroup | None) -> Any:
    from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
    from workers.actor import DataParallelPPOActor
    from workers.fsdp import build_lr_scheduler, build_optimizer

    optim = OptimConfig(lr=1e-3, eps=1e-4)  # eps: see tests/unit/workers/test_dp_actor.py
    opt = build_optimizer(model, optim)
    algorithm = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, entropy_coeff=0.01)
    return DataParallelPPOActor(
        model,
        opt,
        build_lr_scheduler(opt, optim, 10),
        config=ActorConfig(),
        algorithm=algorithm,
        plan=plan,
        dp_group=group,
    )


def _meta_init_checks(rank: int, model_dir: str, mesh: Any, data: Any) -> dict[str, Any]:
    from rlhf_ops.config.schema import FSDPConfig
    from workers.fsdp import build_fsdp_model, load_hf_model

    model = build_fsdp_model(model_dir, kind="causal_lm", mesh=mesh, cfg=FSDPConfig(), device="cpu")
    plain = load_hf_model(model_dir, kind="causal_lm")
    out = {"meta_logits_diff": float((_forward(model, data) - _forward(plain, data)).abs().max())}
    torch.manual_seed(100 + rank)  # different RNG per rank: the value head must still be rank 0's
    critic = build_fsdp_model(model_dir, kind="value", mesh=mesh, cfg=FSDPConfig(), device="cpu")
    values = _forward(critic, data)
    gathered = [torch.empty_like(values) for _ in range(WORLD)]
    dist.all_gather(gathered, values)
    out["value_rank_diff"] = float((gathered[0] - gathered[1]).abs().max())
    return out


def _dp2_update(rank: int, model_dir: str, data: Any, *, hsdp: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """FSDP (1-D mesh of 2) or HSDP (2 replicas x 1 shard) update of rank ``rank``'s half of ``data``."""
    from rlhf_ops.config.schema import FSDPConfig
    from tests.unit.workers.fsdp_test_batch import make_plan
    from workers.fsdp import build_device_mesh, build_fsdp_model

    cfg = FSDPConfig(hsdp_replicate_size=2 if hsdp else 1)
    mesh = build_device_mesh(WORLD, replicate_size=cfg.hsdp_replicate_size)
    model = build_fsdp_model(model_dir, kind="causal_lm", mesh=mesh, cfg=cfg, device="cpu")
    # Rank r holds rows 4r..4r+3: 2 mini-batches of 2 rows per rank, micro 1 (2 accumulation steps).
    actor = _actor(model, make_plan(dp_size=2, mini_per_rank=2, micro_per_rank=1), group=None)
    metrics = actor.update_policy(data.chunk(WORLD)[rank])
    return metrics, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
    from workers.fsdp import build_device_mesh, load_hf_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        singletons = [dist.new_group([r]) for r in range(WORLD)]  # every rank must create every group
        data = make_ppo_batch(batch_size=8, seed=11)
        result = _meta_init_checks(rank, model_dir, build_device_mesh(WORLD), data)
        weights: dict[str, Any] = {}
        for name, hsdp in (("dp2", False), ("hsdp2", True)):
            metrics, weights[name] = _dp2_update(rank, model_dir, data, hsdp=hsdp)
            result.update({f"{name}/{k}": v for k, v in metrics.items()})
        if rank == 0:
            # dp=1 reference: a plain (unwrapped) model, mini-batch j = the rows both ranks used in step j.
            reference = load_hf_model(model_dir, kind="causal_lm")
            dp1 = _actor(reference, make_plan(dp_size=1, mini_per_rank=4, micro_per_rank=4), group=singletons[0])
            dp1_metrics = dp1.update_policy(data.reorder([0, 1, 4, 5, 2, 3, 6, 7]))
            result.update({f"dp1/{k}": v for k, v in dp1_metrics.items()})
            ref = reference.state_dict()
            result["weights"] = {k: (weights["dp2"][k], weights["hsdp2"][k], ref[k]) for k in ref}
            torch.save(result, Path(out_dir) / "result.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp2_result(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_dir = tmp_path_factory.mktemp("fsdp_dp2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(
        _worker, args=(_free_port(), tiny_model_dir, str(out_dir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank FSDP run did not finish in {TIMEOUT_S} s")
    return torch.load(out_dir / "result.pt", weights_only=True)


def test_meta_init_with_rank0_broadcast_gives_the_plain_models_logits(dp2_result: dict[str, Any]) -> None:
    assert dp2_result["meta_logits_diff"] <= 1e-6
    assert dp2_result["value_rank_diff"] == 0.0  # rank 1's randomly drawn value head was replaced by rank 0's


@pytest.mark.parametrize("name", ["dp2", "hsdp2"])
def test_dp2_update_equals_dp1(dp2_result: dict[str, Any], name: str) -> None:
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/pg_clipfrac", "actor/entropy"):
        assert dp2_result[f"{name}/{key}"] == pytest.approx(dp2_result[f"dp1/{key}"], rel=1e-5, abs=1e-8), key
    for param, (dp2, hsdp2, dp1) in dp2_result["weights"].items():
        torch.testing.assert_close(dp2 if name == "dp2" else hsdp2, dp1, rtol=1e-5, atol=1e-7, msg=param)
