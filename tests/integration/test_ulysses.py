"""Ulysses sequence parallelism: sp=2 over 2 gloo ranks equals the single-rank, non-SP computation.

One ``torch.multiprocessing`` spawn runs every distributed check (starting 2 processes costs ~10 s on 2
cores): rank 0 writes the numbers to a file and the tests assert on them. The mesh is dp=1 x sp=2: both ranks
hold the same 8 sequences, FSDP shards parameters over both, and each rank forwards half of every packed
micro-batch. References run on rank 0 with a plain (unwrapped) copy of the same weights, remove padding on.
Updates use SGD with lr=1 and no effective clipping, so a weight change IS the (negated) gradient.

The Ray tests at the end run ``ActorRolloutRefWorker`` with ``actor.ulysses_sequence_parallel_size=2``.
"""

from __future__ import annotations

import dataclasses
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

from rlhf_ops.sampling import SamplingParams
from workers.sp.ulysses import SPShard, gather_seq, packed_causal_mask, shard_packed

pytestmark = pytest.mark.integration

# The rollout's settings (typed, as the controller passes them): temperature-1 sampling of 6 tokens.
SAMPLING = SamplingParams(temperature=1.0, do_sample=True, response_length=6, eos_token_id=2, pad_token_id=0)

WORLD = 2
TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------- single process
def test_packed_causal_mask_separates_sequences_restarting_at_zero() -> None:
    # Sequences [0 1 2] [0 1] and a pad sequence [0]: token i sees j <= i of its own sequence only.
    mask = packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 6, 6)
    assert torch.equal(mask[0, 0], expected)


def test_without_a_group_sharding_and_gathering_are_identities() -> None:
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 0]])
    shard = shard_packed(ids, pos, group=None)
    assert torch.equal(shard.input_ids, ids) and torch.equal(shard.position_ids, pos)
    assert (shard.start, shard.pad, shard.length) == (0, 0, 3)
    values = torch.tensor([1.0, 2.0, 3.0])
    assert gather_seq(values, group=None) is values
    local, index = shard.select(torch.tensor([0, 2]))
    assert local.tolist() == [True, True] and index.tolist() == [0, 2]
    # Kept values at local columns 0 and 2; column 1 is filled with 0.
    assert SPShard.gather(shard, torch.tensor([4.0, 5.0]), index).tolist() == [4.0, 0.0, 5.0]


# ------------------------------------------------------------------------------------- 2-rank spawn
def _collective_checks(rank: int, sp_group: dist.ProcessGroup) -> dict[str, Any]:
    from workers.sp.ulysses import all_to_all

    out: dict[str, Any] = {}
    # gloo all_to_all_single: rank r sends [4r'...]: chunk j of rank r goes to rank j.
    send = torch.arange(4, dtype=torch.float32) + 10 * rank  # rank 0: [0 1 2 3], rank 1: [10 11 12 13]
    recv = torch.empty(4)
    dist.all_to_all_single(recv, send)
    out[f"a2a_single/{rank}"] = recv.tolist()  # rank 0: [0 1 10 11], rank 1: [2 3 12 13]
    # Heads -> sequence: (1, 2 heads, 3 local, 1) -> (1, 1 head, 6, 1), and back again.
    x = (torch.arange(6, dtype=torch.float32) + 100 * rank).reshape(1, 2, 3, 1)
    y = all_to_all(x, group=sp_group, scatter_dim=1, gather_dim=2)
    out[f"a2a_heads/{rank}"] = y.flatten().tolist()
    out[f"a2a_roundtrip/{rank}"] = bool(torch.equal(all_to_all(y, group=sp_group, scatter_dim=2, gather_dim=1), x))
    # Odd packed length 5 over 2 ranks: one pad token at position 0, rank 0 keeps columns 0-2, rank 1 3-5.
    shard = shard_packed(torch.tensor([[7, 8, 9, 10, 11]]), torch.tensor([[0, 1, 2, 0, 1]]), group=sp_group)
    out[f"shard/{rank}"] = (shard.input_ids.tolist(), shard.position_ids.tolist(), shard.start, shard.pad)
    return out


def _plain_copy(fsdp_model: nn.Module, model_dir: str, *, kind: str, attn: str, rank: int) -> nn.Module | None:
    """Rank 0: an unwrapped model holding the FSDP model's full weights (collective; None elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from workers.fsdp import load_hf_model

    full = get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    plain = load_hf_model(model_dir, kind=kind, attn_implementation=attn)  # type: ignore[arg-type]
    plain.load_state_dict(full)
    return plain


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _role(kind: str, model: nn.Module, plan: Any, groups: tuple[Any, Any], *, rmpad: bool = True) -> Any:
    from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, CriticConfig
    from workers.actor import DataParallelPPOActor
    from workers.critic.dp_critic import DataParallelPPOCritic

    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    algorithm = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, entropy_coeff=0.01)
    dp_group, sp_group = groups
    if kind == "value":
        cfg = CriticConfig(use_remove_padding=rmpad, grad_clip=1e6)
        return DataParallelPPOCritic(
            model, sgd, config=cfg, algorithm=algorithm, plan=plan, dp_group=dp_group, sp_group=sp_group
        )
    acfg = ActorConfig(use_remove_padding=rmpad, grad_clip=1e6)
    return DataParallelPPOActor(
        model, sgd, config=acfg, algorithm=algorithm, plan=plan, dp_group=dp_group, sp_group=sp_group
    )


def _plans() -> tuple[Any, Any]:
    """One mini-batch of 8 rows in micro-batches of 4; log-prob micro-batches of 3: (dp=1, dp=1 x sp=2)."""
    from rlhf_ops.config.batch_plan import MeshPlan
    from tests.unit.workers.fsdp_test_batch import make_plan

    plan = make_plan(dp_size=1, mini_per_rank=8, micro_per_rank=4, log_prob_micro=3, num_mini_batches=1)
    mesh = MeshPlan(world_size=2, dp_size=1, sp_size=2, replicate_size=1, shard_size=2)
    return plan, dataclasses.replace(plan, mesh=mesh)


def _config_errors(dp_group: Any, sp_group: Any) -> dict[str, str]:
    plan, sp_plan = _plans()
    errors = {}
    for name, (plan_, rmpad) in {"no_rmpad_error": (sp_plan, False), "plan_error": (plan, True)}.items():
        try:
            _role("causal_lm", nn.Linear(2, 2), plan_, (dp_group, sp_group), rmpad=rmpad)
        except ValueError as err:
            errors[name] = str(err)
    return errors


def _compute_and_update(role: Any, kind: str, data: Any, dynamic: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """Forward outputs (fixed and ``dynamic`` micro-batches), then one update: ``(outputs, metrics)``."""
    if kind == "value":
        outputs = {"values": role.compute_values(data), "dyn": role.compute_values(data, forward=dynamic)}
        return outputs, role.update_critic(data)
    log_probs, entropy = role.compute_log_prob(data, calculate_entropy=True)
    outputs = {"log_probs": log_probs, "entropy": entropy, "dyn": role.compute_log_prob(data, forward=dynamic)[0]}
    return outputs, role.update_policy(data)


def _run_case(
    rank: int, model_dir: str, data: Any, *, kind: str, attn: str, checkpointing: bool, groups: dict[str, Any]
) -> dict[str, Any]:
    """SP run on both ranks, then the non-SP reference on rank 0; returns rank 0's comparisons."""
    from rlhf_ops.config.batch_plan import ForwardPlan
    from rlhf_ops.config.schema import FSDPConfig
    from workers.fsdp import build_fsdp_model

    plan, sp_plan = _plans()
    cfg = FSDPConfig(activation_checkpointing=checkpointing)
    model = build_fsdp_model(
        model_dir,
        kind=kind,
        mesh=groups["fsdp"],
        cfg=cfg,
        device="cpu",
        attn_implementation=attn,  # type: ignore[arg-type]
    )
    plain = _plain_copy(model, model_dir, kind=kind, attn=attn, rank=rank)
    before = _weights(model)
    role = _role(kind, model, sp_plan, (groups["dp"], groups["sp"]))
    out: dict[str, Any] = {"attn_after_enable": str(model.config._attn_implementation)}
    b = data.batch
    with torch.no_grad():  # outside an SP block the Ulysses attention is the base kernel: full padded forward
        full_logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
    dynamic = ForwardPlan(micro_batch_size_per_rank=3, max_token_len_per_rank=20, use_dynamic_bsz=True)
    sp_out, sp_metrics = _compute_and_update(role, kind, data, dynamic)
    after = _weights(model)
    if rank != 0:
        return {}
    assert plain is not None
    with torch.no_grad():
        ref_logits = plain(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
    out["inactive_logits_diff"] = float((full_logits.logits - ref_logits.logits).abs().max())
    ref = _role(kind, plain, plan, (groups["single"], None))
    ref_out, ref_metrics = _compute_and_update(ref, kind, data, dynamic)
    out.update({"sp": sp_out, "ref": ref_out, "sp_metrics": sp_metrics, "ref_metrics": ref_metrics})
    ref_after = plain.state_dict()
    # SGD lr=1 from equal weights: before - after is the gradient of each run.
    out["grads"] = {k: (before[k] - after[k], before[k] - ref_after[k]) for k in ref_after}
    return out


def _worker(rank: int, port: int, model_dirs: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    from tests.unit.workers.fsdp_test_batch import make_ppo_batch
    from workers.fsdp.mesh import build_device_mesh, build_sp_mesh, sp_process_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        singletons = [dist.new_group([r]) for r in range(WORLD)]  # every rank must create every group
        dp_group, sp_group = sp_process_groups(WORLD, sp_size=2)
        assert dp_group is not None and sp_group is not None
        groups = {"fsdp": build_device_mesh(WORLD), "dp": dp_group, "sp": sp_group, "single": singletons[0]}
        result: dict[str, Any] = {"dp_size": dist.get_world_size(dp_group), "sp_size": dist.get_world_size(sp_group)}
        result.update(_collective_checks(rank, sp_group))
        try:
            build_sp_mesh(WORLD, sp_size=3)
        except ValueError as err:
            result["bad_sp_error"] = str(err)
        result.update(_config_errors(dp_group, sp_group))
        data = make_ppo_batch(batch_size=8, prompt_len=6, response_len=5, seed=11)
        cases = {
            "actor_sdpa": (model_dirs["mha"], "causal_lm", "sdpa", False),
            "critic_sdpa": (model_dirs["mha"], "value", "sdpa", False),
            "actor_eager_gqa_ckpt": (model_dirs["gqa"], "causal_lm", "eager", True),
        }
        for name, (model_dir, kind, attn, ckpt) in cases.items():
            case = _run_case(rank, model_dir, data, kind=kind, attn=attn, checkpointing=ckpt, groups=groups)
            result[name] = case
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, {k: v for k, v in result.items() if "/" in k})
        if rank == 0:
            for part in gathered:
                result.update(part)
            torch.save(result, Path(out_dir) / "result.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp2(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from rlhf_ops.models.tiny import build_tiny_model_dir

    # 4 query heads sharing 1 kv head: fewer kv heads than SP ranks (kv repeated before the all-to-all).
    gqa_dir = build_tiny_model_dir(
        tmp_path_factory.mktemp("models") / "tiny-gqa", hidden_size=128, num_heads=4, num_kv_heads=1
    )
    out_dir = tmp_path_factory.mktemp("ulysses_sp2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dirs = {"mha": tiny_model_dir, "gqa": str(gqa_dir)}
    ctx = mp.start_processes(
        _worker, args=(_free_port(), dirs, str(out_dir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank Ulysses run did not finish in {TIMEOUT_S} s")
    return torch.load(out_dir / "result.pt", weights_only=True)


def test_gloo_all_to_all_and_sharding(sp2: dict[str, Any]) -> None:
    assert (sp2["dp_size"], sp2["sp_size"]) == (1, 2)
    assert sp2["a2a_single/0"] == [0.0, 1.0, 10.0, 11.0] and sp2["a2a_single/1"] == [2.0, 3.0, 12.0, 13.0]
    # Rank r gets head r of both ranks: rank 0 -> [0 1 2 | 100 101 102], rank 1 -> [3 4 5 | 103 104 105].
    assert sp2["a2a_heads/0"] == [0.0, 1.0, 2.0, 100.0, 101.0, 102.0]
    assert sp2["a2a_heads/1"] == [3.0, 4.0, 5.0, 103.0, 104.0, 105.0]
    assert sp2["a2a_roundtrip/0"] and sp2["a2a_roundtrip/1"]
    assert sp2["shard/0"] == ([[7, 8, 9]], [[0, 1, 2]], 0, 1)
    assert sp2["shard/1"] == ([[10, 11, 0]], [[0, 1, 0]], 3, 1)  # the pad token starts a sequence at 0
    assert "ulysses_sequence_parallel_size=3" in sp2["bad_sp_error"]


def test_config_errors_name_the_field_and_the_fix(sp2: dict[str, Any]) -> None:
    assert "set actor.use_remove_padding=True" in sp2["no_rmpad_error"]
    assert "the sp group has 2 ranks but plan.mesh.sp_size is 1" in sp2["plan_error"]


CASES = ["actor_sdpa", "critic_sdpa", "actor_eager_gqa_ckpt"]


@pytest.mark.parametrize("name", CASES)
def test_outputs_equal_the_non_sp_run(sp2: dict[str, Any], name: str) -> None:
    case = sp2[name]
    assert case["attn_after_enable"].startswith("ulysses_")
    assert case["inactive_logits_diff"] <= 1e-6  # generation path: the base kernel on full sequences
    mask = torch.ones(8, 5, dtype=torch.bool)
    for key, sp_value in case["sp"].items():
        ref_value = case["ref"][key]
        torch.testing.assert_close(sp_value, ref_value, rtol=0, atol=1e-5, msg=f"{name}/{key}")
        assert sp_value.shape == ref_value.shape == mask.shape


@pytest.mark.parametrize("name", CASES)
def test_loss_and_gradients_equal_the_non_sp_run(sp2: dict[str, Any], name: str) -> None:
    case = sp2[name]
    sp_metrics, ref_metrics = case["sp_metrics"], case["ref_metrics"]
    prefix = "critic" if name.startswith("critic") else "actor"
    keys = ["vf_loss", "grad_norm"] if prefix == "critic" else ["pg_loss", "grad_norm", "kl_loss", "entropy"]
    for key in keys:
        metric = f"{prefix}/{key}"
        assert sp_metrics[metric] == pytest.approx(ref_metrics[metric], rel=1e-5, abs=1e-8), metric
    assert ref_metrics[f"{prefix}/grad_norm"] > 0
    for param, (sp_grad, ref_grad) in case["grads"].items():
        torch.testing.assert_close(sp_grad, ref_grad, rtol=1e-5, atol=1e-7, msg=f"{name}: {param}")


# ------------------------------------------------------------------------------------- Ray worker group
def _actor_group(model_dir: str, world: int, overrides: list[str]) -> tuple[Any, Any]:
    from rlhf_ops.config import load_config
    from tests.support.training import start_actor_group

    config = load_config("tiny-cpu", [f"resources.nproc_per_node={world}", *overrides])
    return start_actor_group(model_dir, config, name="actor_sp", pool_name=f"sp{world}")


def _training_batch() -> Any:
    """8 sequences (4 prompts x n=2): ragged prompts (left pad) and responses (right pad), PPO inputs."""
    from rlhf_ops.padding import compute_position_ids
    from rlhf_ops.protocol import DataProto

    g = torch.Generator().manual_seed(5)
    num, prompt_len, resp_len = 8, 5, 6
    prompts, responses = torch.randint(10, 60, (num, prompt_len), generator=g), torch.randint(10, 60, (num, resp_len))
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


def _prompts(num: int) -> Any:
    from rlhf_ops.padding import compute_position_ids
    from rlhf_ops.protocol import DataProto

    ids = torch.tensor([[1, 5, 19, 31, 32, 41, 71, 69, 13, 70, 6]]).repeat(num, 1)
    ids[:, 8] = torch.arange(num) % 10 + 7  # a different digit token per row
    mask = torch.ones_like(ids)
    mask[::2, 0], ids[::2, 0] = 0, 0  # ragged: every other prompt has one left pad
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)})


@pytest.mark.usefixtures("ray_cluster")
def test_actor_worker_with_sp2_matches_one_rank(tiny_model_dir: str) -> None:
    from workers.clients import ActorRolloutRefClient

    # 4 prompts x n=2 = 8 sequences, one mini-batch, micro-batches of 4 (2 accumulation steps). World 2 with
    # sp=2 is dp=1: both ranks hold all 8 sequences and each forwards half of every packed micro-batch.
    common = [
        "rollout.n=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "actor.use_remove_padding=true",
    ]
    batch, results = _training_batch(), {}
    for world, extra in ((1, []), (2, ["actor.ulysses_sequence_parallel_size=2"])):
        pool, group = _actor_group(tiny_model_dir, world, [*common, *extra])
        try:
            client = ActorRolloutRefClient(group)
            ref = client.compute_ref_log_prob(batch).batch["ref_log_prob"]
            results[world] = (ref, client.update_actor(batch))
            if world == 2:  # rollout (full sequences, SP off) then the SP recompute of the same samples
                out = client.generate_sequences(_prompts(4), SAMPLING)
                # The driver sends the collected (SP leader's) samples to both ranks of the SP group.
                old = client.compute_log_prob(out, temperature=1.0).batch["old_log_probs"]
        finally:
            group.shutdown()
            pool.shutdown()
    (ref1, metrics1), (ref2, metrics2) = results[1], results[2]
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(ref2[mask], ref1[mask], rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"):
        assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-5, abs=1e-8), key
    assert metrics1["actor/grad_norm"] > 0
    gen_mask = out.batch["response_mask"].bool()
    assert out.batch["responses"].shape == (4, 6) and gen_mask.any()
    diff = (out.batch["rollout_log_probs"] - old)[gen_mask].abs().max().item()
    assert diff <= 1e-5, diff
