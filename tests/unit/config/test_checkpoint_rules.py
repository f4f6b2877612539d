"""Error paths of ``trainer.shared_checkpoint_root`` and ``trainer.node_checkpoint_root`` (one line: key, fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config

NO_SHARED = ["trainer.shared_checkpoint_root=false", "trainer.remote_store_url=s3://bucket/runs"]


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_the_default_is_a_shared_root_and_false_is_accepted_with_a_store() -> None:
    assert load_config("tiny-cpu").trainer.shared_checkpoint_root is True
    trainer = load_config("tiny-cpu", [*NO_SHARED, "trainer.node_checkpoint_root=/local/node{rank}"]).trainer
    assert (trainer.shared_checkpoint_root, trainer.node_checkpoint_root) == (False, "/local/node{rank}")
    remote = "trainer.resume_mode=s3://bucket/runs/tiny-cpu/demo/global_step_2"
    assert load_config("tiny-cpu", [*NO_SHARED, remote]).trainer.resume_mode.endswith("global_step_2")


def test_false_without_a_remote_store_names_the_key_and_the_fix() -> None:
    problems = _problems(["trainer.shared_checkpoint_root=false"])
    assert list(problems) == ["trainer.shared_checkpoint_root"]
    line = problems["trainer.shared_checkpoint_root"]
    assert "\n" not in line and "trainer.remote_store_url is not set" in line
    assert "Fix: set trainer.remote_store_url (s3://bucket/prefix" in line


def test_false_refuses_the_hf_export_at_save_and_a_local_resume_path(tmp_path: Path) -> None:
    ckpt = tmp_path / "global_step_2"
    ckpt.mkdir()
    problems = _problems([*NO_SHARED, "trainer.save_hf_model=true", f"trainer.resume_mode={ckpt}"])
    assert sorted(problems) == ["trainer.resume_mode", "trainer.save_hf_model"]
    assert "reads every rank's shards on the driver" in problems["trainer.save_hf_model"]
    assert "Fix: set trainer.save_hf_model=false" in problems["trainer.save_hf_model"]
    assert "the ranks of other nodes cannot read it" in problems["trainer.resume_mode"]
    assert "Fix: give the checkpoint's remote URL" in problems["trainer.resume_mode"]
    file_url = _problems([*NO_SHARED, f"trainer.resume_mode=file://{ckpt}"])
    assert "the ranks of other nodes cannot read it" in file_url["trainer.resume_mode"]


def test_a_node_root_without_false_has_no_effect_and_a_blank_one_is_refused() -> None:
    problems = _problems(["trainer.node_checkpoint_root=/local"])
    assert "only used with trainer.shared_checkpoint_root=false" in problems["trainer.node_checkpoint_root"]
    assert "Fix: unset it" in problems["trainer.node_checkpoint_root"]
    assert "trainer.node_checkpoint_root" in _problems([*NO_SHARED, "trainer.node_checkpoint_root= "])
