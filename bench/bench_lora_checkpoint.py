"""Benchmark: bytes of an adapter-only LoRA checkpoint (``model.lora.save_adapter_only``) against a full one.

Run (CPU; one PPO update, then both checkpoints of the same actor)::

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_lora_checkpoint.py --model builtin:smollm2-135m-instruct --rank 8

The actor is built as the trainer builds it (FSDP2 on a 1-rank gloo group, PEFT LoRA on every linear, AdamW from
the default actor config), takes one ``update_policy`` on a random PPO batch (so both Adam moments exist), and
is saved with ``save_role_checkpoint`` twice: ``adapter_only=True`` (the adapters and their optimizer state)
and ``False`` (every weight, the adapters' optimizer state). Prints both folders' bytes and their ratio.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, LoraConfig  # noqa: E402
from rlhf_ops.models.resolve import resolve_model_path  # noqa: E402
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch  # noqa: E402
from workers.actor.dp_actor import DataParallelPPOActor  # noqa: E402
from workers.checkpointing import save_role_checkpoint  # noqa: E402
from workers.fsdp import build_device_mesh, build_optimizer  # noqa: E402
from workers.fsdp.wrap import build_fsdp_model  # noqa: E402


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model_dir = resolve_model_path(args.model)
    torch.manual_seed(0)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, target_modules="all-linear")
    model = build_fsdp_model(
        model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu", lora=lora
    )
    optimizer = build_optimizer(model, ActorConfig().optim.model_copy(update={"lr": 1e-4}))
    actor = DataParallelPPOActor(
        model, optimizer, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan(), device="cpu"
    )
    vocab = int(model.config.vocab_size)
    actor.update_policy(make_ppo_batch(batch_size=8, vocab=vocab, seed=3))
    root = Path(tempfile.mkdtemp(prefix="bench_lora_ckpt_"))
    sizes = {}
    for kind, adapter_only in (("adapter-only", True), ("full", False)):
        folder = root / kind / "actor"
        save_role_checkpoint(str(folder), actor.module, actor.optimizer, None, adapter_only=adapter_only)
        sizes[kind] = _bytes(folder)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = next(p for p in model.parameters() if p.requires_grad).dtype
    print(
        f"{args.model} LoRA r={args.rank} all-linear: {trainable / 1e6:.2f}M adapter / {params / 1e6:.1f}M parameters "
        f"({dtype}) | full checkpoint {sizes['full'] / 2**20:.1f} MiB | adapter-only "
        f"{sizes['adapter-only'] / 2**20:.1f} MiB | full / adapter-only = {sizes['full'] / sizes['adapter-only']:.1f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
