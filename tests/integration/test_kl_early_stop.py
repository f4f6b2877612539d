"""KL early stop over 2 gloo ranks (torch.multiprocessing, no Ray): the ranks stop together.

Rank 0's old log-probs are 1 nat above its current ones (k3 = e^-1 = 0.368 per token), rank 1's equal its
current ones (k3 = 0). Both ranks hold the same rows, so the token-weighted global KL is (0.368 + 0) / 2 = 0.184
> 1.5 x 0.1: both must skip the first optimizer step and end the update, although rank 1 alone would go on
(a rank that went on alone would wait forever in FSDP's next all-gather).
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration

WORLD = 2
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, OptimConfig
    from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
    from workers.actor import DataParallelPPOActor
    from workers.fsdp import build_device_mesh, build_fsdp_model, build_lr_scheduler, build_optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = build_fsdp_model(
            model_dir, kind="causal_lm", mesh=build_device_mesh(WORLD), cfg=FSDPConfig(), device="cpu"
        )
        before = [p.to_local().detach().clone() for p in model.parameters()]  # this rank's shards
        optim = OptimConfig(lr=1e-3, eps=1e-4)
        opt = build_optimizer(model, optim)
        algorithm = AlgorithmConfig(ppo_target_kl=0.1, ppo_epochs=2)
        actor = DataParallelPPOActor(
            model,
            opt,
            build_lr_scheduler(opt, optim, 10),
            config=ActorConfig(),
            algorithm=algorithm,
            plan=make_plan(dp_size=2, mini_per_rank=2, micro_per_rank=1, ppo_epochs=2),
        )
        data = make_ppo_batch(batch_size=4, seed=5)  # the same rows on both ranks: equal token counts
        old, _ = actor.compute_log_prob(data)
        data.batch["old_log_probs"] = old + (1.0 if rank == 0 else 0.0)
        metrics = actor.update_policy(data)
        after = [p.to_local().detach() for p in model.parameters()]
        changed = max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True) if a.numel())
        torch.save({"metrics": metrics, "max_weight_change": changed}, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("kl_stop")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(
        _worker, args=(_free_port(), tiny_model_dir, str(out_dir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank run did not finish in {TIMEOUT_S} s (a rank that did not stop would hang)")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_both_ranks_stop_at_the_first_mini_batch(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        m = result["metrics"]
        assert m["actor/kl_early_stop"] == 1.0, rank
        assert m["actor/trained_mini_batch_frac"] == 0.0, rank
        # The global k3 is the token-weighted mean over both ranks: (e^-1 + 0) / 2.
        assert m["actor/ppo_kl_k3"] == pytest.approx(math.exp(-1.0) / 2, rel=1e-4), rank
        assert result["max_weight_change"] == 0.0, rank  # no optimizer step anywhere
