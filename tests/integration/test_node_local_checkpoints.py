"""Checkpoints without a shared filesystem (``trainer.shared_checkpoint_root=false``), at the worker level.

A real 2-rank FSDP2 actor group on the session's Ray cluster; each rank's node folder is its own
(``node_run_dir`` with ``{rank}``: two folders standing for two nodes' disks), the driver's run folder a third,
and the store a ``file://`` folder (the session's workers cannot be given S3 credentials after their start; the
S3 path runs in ``test_checkpoint_resume.py`` and ``test_multi_node.py``). ``CheckpointManager`` saves through
the workers' ``save_checkpoint_to_store`` and resumes through ``load_checkpoint_from_store``, as ``rlhf train``
does.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.checkpoint.dcp_reader import SCHEDULER_FILE
from rlhf_ops.checkpoint.manager import CheckpointManager
from rlhf_ops.config import load_config
from rlhf_ops.padding import compute_position_ids
from rlhf_ops.protocol import DataProto
from rlhf_ops.storage.manifest import read_latest, read_manifest
from tests.support.training import start_actor_group
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.clients import ActorRolloutRefClient

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

RUN = Path("exp") / "run"


class _StepState:
    """The trainer side of ``CheckpointManager``: the state it writes to ``trainer_state.json``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["global_step"])


def _batch(num: int = 16, *, prompt_len: int = 4, resp_len: int = 5) -> DataProto:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 60, (num, prompt_len), generator=g)
    responses = torch.randint(10, 60, (num, resp_len), generator=g)
    mask = torch.ones(num, prompt_len + resp_len, dtype=torch.long)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": compute_position_ids(mask),
            "response_mask": torch.ones(num, resp_len, dtype=torch.long),
            "old_log_probs": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
            "advantages": torch.randn(num, resp_len, generator=g),
            "ref_log_prob": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
        }
    )


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_each_rank_uploads_its_own_shards_and_a_fresh_root_resumes_them_exactly(
    tiny_model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config("tiny-cpu", ["resources.nproc_per_node=2", "rollout.n=2"])
    pool, group = start_actor_group(tiny_model_dir, config, role="actor", name="node_local", pool_name="node_local")
    batch = _batch()
    try:
        client = ActorRolloutRefClient(group)
        client.update_actor(batch, step=1)
        saved = group.call(ActorRolloutRefWorker.full_state_dict)[0]
        store, driver = tmp_path / "store", tmp_path / "driver"
        remote = f"file://{store / RUN}"
        manager = CheckpointManager(
            driver / RUN, roles={"actor": client}, remote_url=remote, node_run_dir=f"{tmp_path}/node{{rank}}/{RUN}"
        )
        with caplog.at_level(logging.INFO, logger="rlhf_ops.checkpoint.manager"):
            assert manager.save(_StepState(1)) == f"{remote}/global_step_1"

        # The store: every rank's shards, the driver's state, the manifest (with the bytes' hashes), latest.
        ckpt = store / RUN / "global_step_1"
        manifest = read_manifest(ckpt)
        by_path = {entry.path: entry for entry in manifest.files}
        assert set(by_path) == {
            "actor/.metadata", "actor/__0_0.distcp", f"actor/{SCHEDULER_FILE}", "actor/__1_0.distcp",
            "trainer_state.json",
        }  # fmt: skip
        for path, entry in by_path.items():
            data = (ckpt / path).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256), path
        assert manifest.step == 1 and manifest.extra == {"roles": ["actor"]} and read_latest(store / RUN) == 1
        # Each rank wrote into its own node's folder (rank 0 also DCP's metadata and the scheduler), uploaded and
        # deleted its files; the driver's run folder never held any.
        wrote = sorted(r.getMessage() for r in caplog.records if "uploaded" in r.getMessage())
        assert len(wrote) == 2, wrote
        assert "rank 0 wrote 3 file(s)" in wrote[0] and f"in {tmp_path}/node0/{RUN}/global_step_1," in wrote[0]
        assert "rank 1 wrote 1 file(s)" in wrote[1] and f"in {tmp_path}/node1/{RUN}/global_step_1," in wrote[1]
        assert _files(tmp_path / "node0") == _files(tmp_path / "node1") == _files(driver) == []

        # The uninterrupted run's next step, then the same step again after a resume into empty roots.
        want = client.update_actor(batch, step=2)
        want_weights = group.call(ActorRolloutRefWorker.full_state_dict)[0]
        assert any(not torch.equal(want_weights[k], saved[k]) for k in saved)  # the update moved the weights
        fresh = CheckpointManager(
            tmp_path / "driver2" / RUN,
            roles={"actor": client},
            remote_url=remote,
            node_run_dir=f"{tmp_path}/fresh{{rank}}/{RUN}",
        )
        state = _StepState(0)
        assert fresh.maybe_resume(state) == 1 and state.step == 1
        reloaded = group.call(ActorRolloutRefWorker.full_state_dict)[0]
        assert all(torch.equal(reloaded[k], v) for k, v in saved.items())
        for rank in (0, 1):  # each node downloaded (and verified) its own copy
            assert read_manifest(tmp_path / f"fresh{rank}" / RUN / "global_step_1") == manifest
        got = client.update_actor(batch, step=2)  # optimizer moments and scheduler restored too: the same step
        assert got["actor/pg_loss"] == want["actor/pg_loss"] and got["actor/grad_norm"] == want["actor/grad_norm"]
        got_weights = group.call(ActorRolloutRefWorker.full_state_dict)[0]
        assert all(torch.equal(got_weights[k], v) for k, v in want_weights.items())
    finally:
        group.shutdown()
        pool.shutdown()
