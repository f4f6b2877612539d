"""The "where to change what" recipes, exercised: throw-away entries from outside the package
(``tests/support/extension_entries.py``) selected by dotted path run through the real path, one training step
of the tiny model on the session's Ray cluster (the driver in-process, FSDP2 ranks in Ray workers).

One run covers an advantage estimator (driver), a policy loss and a KL estimator (actor workers), a reward
function (driver) and a rollout engine (rollout workers); each marks that it ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.config import load_config
from tests.support import extension_entries

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

_E = "tests.support.extension_entries"


def test_user_entries_by_dotted_path_train_a_step(tmp_path: Path, tiny_model_dir: str) -> None:
    from workers.entrypoints.train import run_training

    overrides = [
        f"model.path={tiny_model_dir}",
        f"algorithm.adv_estimator={_E}:centered_advantage",
        f"algorithm.policy_loss={_E}:marked_policy_loss",
        f"algorithm.kl_loss_type={_E}:constant_value_kl",
        "algorithm.use_kl_loss=true",
        f"reward.reward_fn={_E}:length_reward",
        f"rollout.engine={_E}:ENGINE",
        "trainer.total_training_steps=1",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "data.val_files=[]",
        f"trainer.checkpoint_root={tmp_path}",
        "trainer.experiment_name=recipes",
        "trainer.run_name=user-entries",
    ]
    extension_entries.CALLS.clear()
    run_training(load_config("tiny-cpu", overrides))
    lines = (tmp_path / "recipes" / "user-entries" / "metrics.jsonl").read_text().splitlines()
    row = json.loads(lines[-1])
    metrics = row.get("metrics", row)
    assert extension_entries.CALLS["advantage"] == 1  # one step, one advantage stage
    assert extension_entries.CALLS["reward"] > 0
    assert metrics["actor/test_policy_loss"] == pytest.approx(1.01)  # 1 + algorithm.entropy_coeff (tiny-cpu: 0.01)
    # constant_value_kl's value is the same on every token, so its token-mean is exactly that value.
    assert metrics["actor/kl_loss"] == pytest.approx(extension_entries.KL_VALUE, abs=1e-6)
    assert "timing_s/worker/test_engine" in metrics
    assert metrics["actor/grad_norm"] > 0


def test_a_user_worker_role_starts_beside_the_built_ins_and_answers_its_dispatch(tiny_model_dir: str) -> None:
    import torch

    from rlhf_ops.config import derive_batch_plan
    from rlhf_ops.protocol import DataProto
    from tests.support.extension_role import ROLE
    from workers.launcher import launch_role_groups
    from workers.roles import WORKER_ROLES

    config = load_config("tiny-cpu", [f"model.path={tiny_model_dir}", "algorithm.gamma=0.5"])
    plan = derive_batch_plan(config, steps_per_epoch=4)
    WORKER_ROLES.register(ROLE)
    try:
        groups = launch_role_groups(config, plan, model_path=tiny_model_dir, pad_token_id=0, eos_token_id=(2,))
    finally:
        WORKER_ROLES.unregister(ROLE.name)
    try:
        assert list(groups.clients) == ["actor_rollout_ref", "length_scorer"]  # table order, the built-in first
        mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
        out = groups.clients["length_scorer"].score_lengths(DataProto.from_dict({"response_mask": mask}))
        assert out.batch["length_scores"].tolist() == [1.5, 0.5, 1.0, 2.0]  # tokens 3, 1, 2, 4 times gamma 0.5
        world = config.resources.nproc_per_node * config.resources.nnodes
        assert sorted(set(out.batch["scored_by"].tolist())) == [float(r) for r in range(world)]  # split over ranks
    finally:
        groups.shutdown()
