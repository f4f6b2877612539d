"""The reward model's FSDP mesh comes from ``reward.fsdp`` (``fsdp_size`` / ``hsdp_replicate_size``), like the actor's.

The plan derives it once (``BatchPlan.reward_model``), the launcher hands it to the worker, and the worker builds
its mesh from it. The last test starts the real worker on 2 gloo ranks (one spawn, ~10-20 s on 2 cores).
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

from rlhf_ops.config import ConfigError, derive_batch_plan, load_config
from rlhf_ops.config.batch_plan import MeshPlan
from workers.launcher import role_table
from workers.reward_model.reward_model_worker import RewardModelSpec

WORLD = 2  # tiny-cpu: 1 node x 2 ranks
TIMEOUT_S = 240
RM = ["reward.model_path=/rm"]


def _plan_mesh(overrides: list[str]) -> MeshPlan | None:
    return derive_batch_plan(load_config("tiny-cpu", overrides)).reward_model


def test_the_plan_gives_the_reward_model_the_mesh_of_its_own_fsdp_section() -> None:
    plain = MeshPlan(world_size=2, dp_size=2, sp_size=1, replicate_size=1, shard_size=2)
    hsdp = MeshPlan(world_size=2, dp_size=2, sp_size=1, replicate_size=2, shard_size=1)
    assert _plan_mesh(RM) == plain  # default: shard over all ranks
    assert _plan_mesh([*RM, "reward.fsdp.fsdp_size=1"]) == hsdp  # shard groups of 1 rank, 2 replicas
    assert _plan_mesh([*RM, "reward.fsdp.hsdp_replicate_size=2"]) == hsdp  # the same mesh, by replica count
    assert _plan_mesh([]) is None  # no reward model, no mesh
    # Its own section: the actor keeps plain FSDP, and the actor's HSDP does not reach the reward model.
    config = load_config("tiny-cpu", [*RM, "reward.fsdp.fsdp_size=1"])
    assert derive_batch_plan(config).actor.mesh.replicate_size == 1
    assert _plan_mesh([*RM, "actor.fsdp.hsdp_replicate_size=2"]) == plain


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("reward.fsdp.hsdp_replicate_size=3", "reward.fsdp.hsdp_replicate_size"),
        ("reward.fsdp.fsdp_size=3", "reward.fsdp.fsdp_size"),
    ],
)
def test_a_reward_mesh_that_does_not_divide_the_world_is_refused(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [*RM, override])
    assert key in [p.key for p in info.value.problems]
    load_config("tiny-cpu", [override])  # without a reward model the section is not used: no problem


def _reward_spec(overrides: list[str], model_path: str) -> RewardModelSpec:
    config = load_config("tiny-cpu", [f"reward.model_path={model_path}", *overrides])
    plan = derive_batch_plan(config, steps_per_epoch=4)
    rows = role_table(
        config, plan, model_path="/m", pad_token_id=0, eos_token_id=(2,), profile_steps=(), profile_dir="/p"
    )
    [spec] = [spec for name, _, spec in rows if name == "reward_model"]
    assert isinstance(spec, RewardModelSpec) and spec.mesh == plan.reward_model
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, specs: dict[str, RewardModelSpec], out_dir: str) -> None:
    torch.set_num_threads(1)
    from rlhf_ops.protocol import DataProto
    from workers.reward_model.reward_model_worker import RewardModelWorker
    from workers.single_controller.worker import RankContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ids = torch.tensor([[1, 40, 41, 42, 43, 0], [1, 50, 51, 52, 53, 54]])
        mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6])
        data = DataProto.from_dict(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                "response_mask": mask[:, 3:],
            }
        )
        result: dict[str, Any] = {}
        for name, spec in specs.items():
            worker = RewardModelWorker(RankContext(rank=rank, world_size=WORLD), spec=spec)
            worker.init_model()
            weight = worker.module.get_input_embeddings().weight  # a DTensor on the worker's mesh
            result[name] = {
                "mesh_shape": tuple(weight.device_mesh.shape),
                "mesh_dims": weight.device_mesh.mesh_dim_names,
                "local_rows": weight.to_local().shape[0],
                "rows": weight.shape[0],
                "scores": worker.compute_rm_score(data).batch["rm_scores"],
            }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_reward_model_worker_builds_its_mesh_from_reward_fsdp(tmp_path: Path) -> None:
    from tests.support.builders import build_tiny_reward_model_dir

    model_dir = str(build_tiny_reward_model_dir(tmp_path / "tiny-rm"))
    specs = {
        "plain": _reward_spec([], model_dir),
        "fsdp_size_1": _reward_spec(["reward.fsdp.fsdp_size=1"], model_dir),
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(
        _worker, args=(_free_port(), specs, str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank reward model did not finish in {TIMEOUT_S} s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for got in ranks:
        plain, hsdp = got["plain"], got["fsdp_size_1"]
        assert (plain["mesh_shape"], plain["mesh_dims"]) == ((2,), ("fsdp",))
        assert plain["local_rows"] * 2 == plain["rows"]  # each rank holds half the embedding rows
        assert (hsdp["mesh_shape"], hsdp["mesh_dims"]) == ((2, 1), ("replicate", "shard"))
        assert hsdp["local_rows"] == hsdp["rows"]  # shard groups of one rank: the whole tensor, replicated
        # The mesh changes where the weights live, not the scores.
        torch.testing.assert_close(hsdp["scores"], plain["scores"], atol=1e-6, rtol=0)
        assert hsdp["scores"].shape == (2, 3) and bool((plain["scores"] != 0).any())
    torch.testing.assert_close(ranks[0]["plain"]["scores"], ranks[1]["plain"]["scores"])
