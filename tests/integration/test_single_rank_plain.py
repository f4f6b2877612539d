"""``fsdp.single_rank_plain``: a one-rank role without FSDP2 trains the same steps and its DCP checkpoints resume
under FSDP2 (and the other way round), through the real entrypoint on the session's Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_ops.config import dump_config, load_config
from tests.integration.test_checkpoint_resume import COMMON, _assert_same_metrics, _records, _train

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

# One rank, 2 steps per epoch, 3 steps, a checkpoint at step 2 (the last step of epoch 0).
ONE_RANK = ["resources.nproc_per_node=1", "trainer.total_epochs=2", "trainer.total_training_steps=3"]
PLAIN = ["actor.fsdp.single_rank_plain=true", "ref.fsdp.single_rank_plain=true"]


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("preset") / "plain.yaml"
    path.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON, *ONE_RANK])))
    return str(path)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str) -> Path:
    return _train(tmp_path_factory.mktemp("fsdp"), preset, ray_address, [])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str) -> Path:
    return _train(tmp_path_factory.mktemp("plain"), preset, ray_address, PLAIN)


def test_plain_parameters_train_the_same_steps_as_fsdp2_on_one_rank(fsdp_run: Path, plain_run: Path) -> None:
    fsdp, plain = _records(fsdp_run), _records(plain_run)
    assert [r["step"] for r in plain] == [1, 2, 3]
    assert plain[0]["actor/grad_norm"] > 0  # a real update happened
    _assert_same_metrics(plain, fsdp)


@pytest.mark.parametrize(("saved_by", "resumed_with"), [("plain", []), ("fsdp", PLAIN)])
def test_a_checkpoint_resumes_across_the_two_layouts_exactly(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    preset: str,
    ray_address: str,
    saved_by: str,
    resumed_with: list[str],
) -> None:
    source: Path = request.getfixturevalue(f"{saved_by}_run")
    want = _records(source)[2:]  # step 3 of the uninterrupted run
    resumed = _train(tmp_path, preset, ray_address, [*resumed_with, f"trainer.resume_mode={source / 'global_step_2'}"])
    got = _records(resumed)
    assert [r["step"] for r in got] == [3]
    _assert_same_metrics(got, want)
