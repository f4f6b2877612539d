"""The registered champion is an MLflow Model: ``mlflow.pyfunc.load_model("models:/<name>@champion")`` generates.

The ``register`` job (as the ``register_model`` Ray job runs it) on a run with one evaluated checkpoint of the tiny
model (its weights moved, saved as the trainer saves the actor: DCP, committed with a manifest), against a real
MLflow server. The champion then loads through MLflow's pyfunc and transformers flavours, with the checkpoint's
weights, carries the model card, and its ``model/`` folder still warm-starts a run (``fetch_champion``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from rlhf_ops.pipeline.checkpoints import EVAL_FILE
from rlhf_ops.pipeline.heavy.register import RegisterRequest
from rlhf_ops.pipeline.job_requests import RunRef
from rlhf_ops.pipeline.job_results import read_result
from rlhf_ops.pipeline.jobs import run_job
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.register import fetch_champion
from rlhf_ops.storage.manifest import step_dir_name, write_manifest
from tests.support.mlflow_server import mlflow_server
from tests.unit.pipeline.test_promotion import report, right

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

NAME = "champion-model-it"
PROMPT = "copy: 7"


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


def _trained_checkpoint(layout: RunLayout, model_dir: str, step: int) -> dict[str, torch.Tensor]:
    """Checkpoint ``step`` of the run: the tiny model's weights moved by noise, as the actor's DCP shards."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(step)
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    ckpt = Path(layout.local_run_dir) / step_dir_name(step)
    dcp.save({"model": weights}, checkpoint_id=str(ckpt / "actor"), no_dist=True)
    write_manifest(ckpt, step=step)
    (ckpt / EVAL_FILE).write_text(json.dumps(report(right(60))))  # written beside it by the evaluate task
    return weights


def _config(model_dir: str) -> dict[str, Any]:
    return {
        "model": {"path": model_dir},
        "data": {"train_files": ["s3://data/run/train.parquet"], "val_files": ["s3://data/run/val.parquet"]},
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001},
        "actor": {"optim": {"lr": 0.001}},
        "reward": {"reward_fn": None},
    }


def test_registered_champion_loads_with_pyfunc_and_generates(
    tracking_uri: str, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc
    import mlflow.transformers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)  # as RayTaskJobOperator passes mlflow_default
    run = RunRef(
        dag_id="champion_dag",
        run_id="manual__1",
        work_dir=str(tmp_path / "work"),
        remote_store_url=(tmp_path / "store").as_uri(),
    )
    layout = run.layout()
    weights = _trained_checkpoint(layout, tiny_model_dir, step=2)
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("champion-model-it")).info.run_id
    request = RegisterRequest(
        run=run,
        config=_config(tiny_model_dir),
        mlflow_run_id=run_id,
        registered_name=NAME,
        metric="eval/acc",
        eval_n_samples=1,
        eval_max_prompts=4,
    )
    env = {"RLHF_SUBMISSION_ID": "af-register", "RLHF_JOB_REQUEST": request.model_dump_json()}
    code = run_job("register", environ=env)
    result = read_result("af-register", remote_run_url=run.remote_run_url, logs=lambda: "")
    assert code == 0 and result is not None and result["status"] == "ok", result
    assert result["value"]["promoted"] and result["value"]["model_uri"] == f"runs:/{run_id}/model"

    uri = f"models:/{NAME}@champion"
    pyfunc = mlflow.pyfunc.load_model(uri)
    out = pyfunc.predict([PROMPT], params={"max_new_tokens": 4, "do_sample": False})
    assert len(out) == 1 and isinstance(out[0], str) and out[0].startswith(PROMPT), out
    # The pipeline holds the checkpoint's weights (not the base model's); greedy generation is theirs.
    pipe = mlflow.transformers.load_model(uri)
    state = pipe.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    ids = pipe.tokenizer(PROMPT, return_tensors="pt")
    greedy = pipe.model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out[0] == pipe.tokenizer.decode(greedy[0], skip_special_tokens=True)

    # The MLflow Model: both flavours, the card from the export's README.md (base model, data, algorithm, metrics).
    root = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", dst_path=str(tmp_path / "dl")))
    mlmodel = (root / "MLmodel").read_text()
    assert "python_function:" in mlmodel and "transformers:" in mlmodel and "task: text-generation" in mlmodel
    readme = (root / "model" / "README.md").read_text()
    card, card_data = (root / "model_card.md").read_text(), (root / "model_card_data.yaml").read_text()
    assert card.strip() in readme and f"base_model: {tiny_model_dir}" in card_data and "- grpo" in card_data
    for text in (tiny_model_dir, "s3://data/run/train.parquet", "s3://data/run/val.parquet", "global_step_2`, step 2"):
        assert text in card
    assert "| adv_estimator | `grpo` |" in card and "| eval/acc | `0.6` |" in card

    # The warm start still gets a plain HF folder (from_pretrained) out of the MLflow Model.
    fetched = fetch_champion(NAME, models_dir=str(tmp_path / "models"), tracking_uri=tracking_uri)
    assert fetched["version"] == "1" and Path(fetched["model_dir"]).name == "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in Path(fetched["model_dir"]).iterdir()
    }
