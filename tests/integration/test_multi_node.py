"""Training on a real two-node Ray cluster on this machine: ``resources.nnodes=2, resources.nproc_per_node=1``.

Two raylets (``ray.cluster_utils.Cluster``: a head and a second node, each with 1 CPU and a resource of its own,
``node_a`` / ``node_b``), moto S3 as the remote store. ``rlhf train`` (the Ray job entrypoint, in its own process)
connects to the head and trains tiny-cpu for 2 steps with a checkpoint at step 2 synced to S3:

* placement: the resource pool puts one rank on each node (one STRICT_SPREAD placement group of one bundle per
  node entry; the ranks report the node ids they run on, and those are the two raylets');
* the process group: one gloo group of world size 2 spans both nodes (the driver logs it from the ranks);
* checkpoints without a shared filesystem (``trainer.shared_checkpoint_root=false``): each rank writes its DCP
  shards into its own node's folder (``node_checkpoint_root=<disk>/node{rank}``: one folder per raylet), uploads
  them to S3 itself and deletes them; the driver writes the manifest after both uploads; its own run folder never
  holds a shard;
* a second ``rlhf train`` to step 3 with *empty* folders of its own (another driver's and two other nodes' disks)
  resumes from the S3 copy only (downloaded and verified on the driver and on each node, then loaded by both
  ranks) and trains step 3 once.

Not covered here: separate machines (both raylets share this machine's filesystem and loopback: the node folders
stand for two disks); NCCL across nodes. 47 s here on a quiet machine (slow: near the default suite's budget).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.moto_server import aws_env, running_moto_server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "rlhf-multinode"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and a second raylet on this machine (no auth, loopback), shut down at the end."""
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE",)}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1})
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with running_moto_server() as moto:
        moto.create_bucket(BUCKET)
        yield moto


def _train(cluster: Any, s3: Any, root: Path, steps: int, log: Path) -> str:
    """``rlhf train`` on the cluster into ``root`` (its local checkpoint root); returns its output."""
    overrides = [
        "resources.nnodes=2",
        "resources.nproc_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.checkpoint_root={root}",
        "trainer.experiment_name=multinode",
        "trainer.run_name=two-raylets",
        f"trainer.remote_store_url=s3://{BUCKET}/runs",
        "trainer.shared_checkpoint_root=false",  # the ranks upload their own shards (credentials forwarded)
        f"trainer.node_checkpoint_root={root}/node{{rank}}",
        "trainer.logger=[console,jsonl]",
    ]
    env = {
        **os.environ,
        **aws_env(s3.endpoint_url),
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--ray-address", cluster.address, *overrides]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    out = done.stdout + done.stderr
    log.write_text(out)
    assert done.returncode == 0, out[-4000:]
    return out


def _rank_nodes(out: str) -> dict[str, list[str]]:
    """``{role: [node id of rank 0, rank 1, ...]}`` from the worker groups' process-group lines."""
    found = {}
    pattern = r"\[(\w+)\] \w+ process group of (\d+) rank\(s\) across \d+ node\(s\) .*?; rank -> node: (.+)"
    for role, world, pairs in re.findall(pattern, out):
        nodes = [pair.split(":", 1)[1].strip() for pair in pairs.split(",")]
        assert int(world) == len(nodes), (role, world, pairs)
        found[role] = nodes
    return found


def test_two_ranks_on_two_raylets_train_and_resume_from_the_remote_store(
    cluster: Any, s3: Any, tmp_path: Path
) -> None:
    node_ids = {node.node_id for node in cluster.list_all_nodes()}
    assert len(node_ids) == 2
    first = _train(cluster, s3, tmp_path / "disk_a", 2, tmp_path / "first.log")
    # Placement: one rank on each raylet, in the pool and where the processes really run.
    placed = re.search(r"resource pool .*: 2 rank\(s\) on (\d) node\(s\); rank -> node: (.+)", first)
    assert placed and placed.group(1) == "2", first[-3000:]
    ranks = _rank_nodes(first)
    assert ranks, first[-3000:]
    for role, nodes in ranks.items():
        assert len(nodes) == 2 and set(nodes) == node_ids, (role, nodes, node_ids)
    # One gloo process group of world size 2 over both nodes (the training's collectives ran on it).
    assert re.search(r"\] gloo process group of 2 rank\(s\) across 2 node\(s\)", first)
    client = s3.client()
    prefix = "runs/multinode/two-raylets"
    assert client.get_object(Bucket=BUCKET, Key=f"{prefix}/latest")["Body"].read() == b"global_step_2"
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/MANIFEST.json")["Body"].read())
    shards = sorted(f["path"] for f in manifest["files"] if f["path"].startswith("actor/__"))
    assert shards == ["actor/__0_0.distcp", "actor/__1_0.distcp"], shards  # one writer per rank, both listed
    for entry in manifest["files"]:  # what each rank hashed on its node is what the store holds
        data = client.get_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/{entry['path']}")["Body"].read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"]), entry["path"]
    disk_a = tmp_path / "disk_a"
    for rank in (0, 1):  # written on its own node's disk, uploaded from there, deleted
        assert f"[actor] rank {rank} wrote" in first and f"in {disk_a}/node{rank}/multinode/two-raylets" in first
    assert not [p for p in disk_a.rglob("*") if p.is_file() and p.name.endswith(".distcp")]
    assert not (disk_a / "multinode" / "two-raylets" / "global_step_2").exists()  # the driver's run folder
    # Other disks: nothing local, so the run resumes from S3 alone and trains step 3 once.
    second = _train(cluster, s3, tmp_path / "disk_b", 3, tmp_path / "second.log")
    assert "downloading checkpoint s3://" in second and "resumed from" in second, second[-3000:]
    for rank in (0, 1):  # each node fetched its own verified copy
        node_copy = tmp_path / "disk_b" / f"node{rank}" / "multinode" / "two-raylets" / "global_step_2"
        assert json.loads((node_copy / "MANIFEST.json").read_text())["files"] == manifest["files"]
    run_b = tmp_path / "disk_b" / "multinode" / "two-raylets"
    steps = [json.loads(line)["step"] for line in (run_b / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [3], steps
    for role, nodes in _rank_nodes(second).items():
        assert set(nodes) == node_ids, (role, nodes)
