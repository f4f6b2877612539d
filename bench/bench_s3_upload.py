"""Checkpoint upload throughput: ``sync_checkpoint`` vs plain boto3 ``upload_file``, same bytes, same run.

Starts moto's S3 server on 127.0.0.1 (its own process), writes a checkpoint-like folder (a few large
shards and many small files, ~200 MB of random bytes by default), then uploads it alternately with

- baseline: ``boto3`` ``upload_file`` of each file in turn (boto3's default transfer config: multipart
  from 8 MiB, 10 threads per file), the usual hand-written loop;
- ours: ``sync_checkpoint`` (files in parallel, multipart for large files, manifest then ``latest``),
  with its defaults and with a multipart-heavy setting.

Each is run ``--rounds`` times into a fresh prefix (objects deleted after each round); the best round
counts. Both clients talk to the same single-process moto server on this machine, so the absolute
numbers measure moto and the CPU more than a real S3, and the ratio is what to read.

Usage: ``.venv/bin/python bench/bench_s3_upload.py [--total-mb 200] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support when run as a script

from rlhf_ops.storage import sync_checkpoint  # noqa: E402
from rlhf_ops.storage.manifest import write_manifest  # noqa: E402
from tests.support.moto_server import running_moto_server  # noqa: E402

MiB = 2**20


def make_checkpoint(root: Path, total_mb: int) -> tuple[Path, int]:
    """4 large shards holding 80% of the bytes, 512 KiB files for the rest; returns (folder, bytes)."""
    ckpt = root / "global_step_100"
    large = total_mb * MiB * 8 // 10 // 4
    small_count = max(1, total_mb * MiB * 2 // 10 // (512 * 1024))
    sizes = {f"model/__{i}_0.distcp": large for i in range(4)}
    sizes |= {f"optim/small_{i:03d}.distcp": 512 * 1024 for i in range(small_count)}
    for rel, size in sizes.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(os.urandom(size))
    return ckpt, sum(sizes.values())


def empty_bucket(client: object, bucket: str) -> None:
    paginator = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    for page in paginator.paginate(Bucket=bucket):
        objects = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects})  # type: ignore[attr-defined]


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, running_moto_server() as moto:
        os.environ.update(moto.env())
        client = moto.client()
        bucket = moto.create_bucket("bench-ckpt")
        ckpt, total = make_checkpoint(Path(tmp), args.total_mb)
        files = sorted(p for p in ckpt.rglob("*") if p.is_file())
        hash_s = timed(lambda: write_manifest(ckpt, step=100))
        print(f"checkpoint: {len(files)} files, {total / 1e6:.1f} MB; write_manifest {total / 1e6 / hash_s:.0f} MB/s")

        def boto3_loop(prefix: str) -> None:
            for path in files:
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(ckpt).as_posix()}")

        variants: dict[str, Callable[[str], object]] = {
            "boto3 upload_file loop": boto3_loop,
            "sync_checkpoint (defaults)": lambda prefix: sync_checkpoint(ckpt, f"s3://{bucket}/{prefix}"),
            "sync_checkpoint (8 MiB parts, 8 files)": lambda prefix: sync_checkpoint(
                ckpt, f"s3://{bucket}/{prefix}", max_workers=8, multipart_threshold=16 * MiB, part_size=8 * MiB
            ),
        }
        best: dict[str, float] = {}
        for round_index in range(args.rounds):
            for name, upload in variants.items():
                seconds = timed(upload, f"r{round_index}")
                best[name] = min(best.get(name, float("inf")), seconds)
                print(f"  round {round_index}: {name:42s} {total / 1e6 / seconds:7.1f} MB/s ({seconds:.2f} s)")
                empty_bucket(client, bucket)

        sync_checkpoint(ckpt, f"s3://{bucket}/again")
        incremental_s = timed(lambda: sync_checkpoint(ckpt, f"s3://{bucket}/again"))
        baseline = total / 1e6 / best["boto3 upload_file loop"]
        print("\nbest of", args.rounds, "rounds:")
        for name, seconds in best.items():
            rate = total / 1e6 / seconds
            print(f"  {name:42s} {rate:7.1f} MB/s   ratio vs boto3 loop {rate / baseline:5.2f}x")
        print(f"  incremental re-sync of the unchanged checkpoint: {incremental_s:.3f} s (nothing uploaded)")


if __name__ == "__main__":
    main()
