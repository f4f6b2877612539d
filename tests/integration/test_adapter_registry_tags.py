"""A registered LoRA adapter records the base model it needs (MLflow model version tags).

The ``register`` job (as the ``register_model`` Ray job runs it) on a run whose one evaluated checkpoint is an
adapter-only LoRA checkpoint of the tiny Llama (saved by ``save_role_checkpoint`` after one PPO update), against a
real MLflow server. The base model sits in a Hugging Face cache layout (``.../snapshots/<commit>/``), so the
version also records that commit as the base's revision.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mlflow import MlflowClient

from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, LoraConfig
from rlhf_ops.pipeline.checkpoints import EVAL_FILE
from rlhf_ops.pipeline.heavy.register import RegisterRequest
from rlhf_ops.pipeline.job_requests import RunRef
from rlhf_ops.pipeline.job_results import read_result
from rlhf_ops.pipeline.jobs import run_job
from rlhf_ops.storage.manifest import step_dir_name, write_manifest
from tests.support.mlflow_server import mlflow_server
from tests.unit.pipeline.test_promotion import report, right
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.actor.dp_actor import DataParallelPPOActor
from workers.checkpointing import save_role_checkpoint
from workers.fsdp import build_device_mesh, build_optimizer
from workers.fsdp.wrap import build_fsdp_model

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

NAME = "adapter-registry-it"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


def _adapter_checkpoint(ckpt: Path, base_dir: str) -> None:
    """An adapter-only LoRA checkpoint of ``base_dir`` after one update, committed and evaluated."""
    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        lora = LoraConfig(rank=4, alpha=8, target_modules="all-linear", save_adapter_only=True)
        model = build_fsdp_model(
            base_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu", lora=lora
        )
        optimizer = build_optimizer(model, ActorConfig().optim.model_copy(update={"lr": 1e-2}))
        actor = DataParallelPPOActor(
            model, optimizer, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan(), device="cpu"
        )
        actor.update_policy(make_ppo_batch(batch_size=8, seed=3))
        save_role_checkpoint(str(ckpt / "actor"), actor.module, actor.optimizer, None, adapter_only=True)
    finally:
        if owned:
            dist.destroy_process_group()
    write_manifest(ckpt, step=2)
    (ckpt / EVAL_FILE).write_text(json.dumps(report(right(60))))  # written beside it by the evaluate task


def _config(model_path: str) -> dict[str, Any]:
    return {
        "model": {"path": model_path, "lora": {"rank": 4, "alpha": 8, "save_adapter_only": True}},
        "data": {"train_files": ["s3://data/run/train.parquet"], "val_files": ["s3://data/run/val.parquet"]},
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001},
        "actor": {"optim": {"lr": 0.01}},
        "reward": {"reward_fn": None},
    }


def test_registered_adapter_records_its_base_model(
    tracking_uri: str, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)  # as RayTaskJobOperator passes mlflow_default
    base = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT  # a Hugging Face cache snapshot
    shutil.copytree(tiny_model_dir, base)
    run = RunRef(
        dag_id="adapter_dag",
        run_id="manual__1",
        work_dir=str(tmp_path / "work"),
        remote_store_url=(tmp_path / "store").as_uri(),
    )
    layout = run.layout()
    _adapter_checkpoint(Path(layout.local_run_dir) / step_dir_name(2), str(base))
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("adapter-registry-it")).info.run_id
    request = RegisterRequest(
        run=run,
        config=_config(str(base)),
        mlflow_run_id=run_id,
        registered_name=NAME,
        metric="eval/acc",
        eval_n_samples=1,
        eval_max_prompts=4,
    )
    env = {"RLHF_SUBMISSION_ID": "af-register-adapter", "RLHF_JOB_REQUEST": request.model_dump_json()}
    code = run_job("register", environ=env)
    result = read_result("af-register-adapter", remote_run_url=run.remote_run_url, logs=lambda: "")
    assert code == 0 and result is not None and result["status"] == "ok", result

    tags = client.get_model_version(NAME, result["value"]["version"]).tags
    weights = base / "model.safetensors"
    expected = hashlib.sha256(b"model.safetensors\0" + weights.read_bytes()).hexdigest()
    assert tags["rlhf.adapter_base_model"] == str(base)
    assert tags["rlhf.adapter_base_model_sha256"] == expected
    assert tags["rlhf.adapter_base_model_revision"] == COMMIT
    assert tags["rlhf.adapter_path"] == "model/adapter"
    # The adapter folder is in the version's artifacts, and its PEFT config names the same base.
    listed = {Path(a.path).name for a in client.list_artifacts(run_id, "model/model/adapter")}
    assert listed == {"adapter_config.json", "adapter_model.safetensors"}
    local = client.download_artifacts(run_id, "model/model/adapter/adapter_config.json", str(tmp_path / "dl"))
    adapter_config = json.loads(Path(local).read_text())
    assert adapter_config["base_model_name_or_path"] == str(base) and adapter_config["r"] == 4
