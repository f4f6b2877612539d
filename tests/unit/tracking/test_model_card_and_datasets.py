"""The model card an export carries, and the dataset inputs of the pipeline's run, built without a server."""

from __future__ import annotations

import json

from rlhf_ops.checkpoint.model_card import ModelCard, card_from_config, render_model_card
from rlhf_ops.tracking.datasets import dataset_inputs

CONFIG = {
    "model": {"path": "/models/qwen2.5-0.5b"},
    "data": {"train_files": ["s3://d/train.parquet"], "val_files": []},
    "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001, "norm_adv": True},
    "actor": {"optim": {"lr": 1e-6}},
    "reward": {"reward_fn": "gsm8k"},
}


def test_card_from_config_names_base_model_data_algorithm_and_metrics() -> None:
    card = card_from_config(CONFIG, checkpoint="s3://ck/run/global_step_40", step=40, metrics={"eval/acc": 0.25})
    text = render_model_card(card)
    front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    assert 'base_model: "/models/qwen2.5-0.5b"' in front and 'datasets: ["s3://d/train.parquet"]' in front
    assert 'tags: ["rlhf", "rlhf-ops", "grpo"]' in front
    assert "`s3://ck/run/global_step_40`, step 40" in body
    assert "| train | `s3://d/train.parquet` |" in body and "| validation |" in body  # an empty split stays listed
    # Only algorithm keys the card knows (norm_adv is not one), the learning rate and the reward function.
    assert "| kl_loss_coef | `0.001` |" in body and "| actor.optim.lr | `1e-06` |" in body and "norm_adv" not in body
    assert "| reward_fn | `gsm8k` |" in body and "| eval/acc | `0.25` |" in body


def test_a_bare_export_card_says_what_was_not_recorded() -> None:
    body = render_model_card(ModelCard(base_model="builtin:tiny-llama"))
    assert body.count("not recorded") == 4  # checkpoint, data, algorithm, metrics


def test_dataset_inputs_carry_source_digest_and_context_and_skip_an_empty_split() -> None:
    prepared = {"run_id": "r1", "train_url": "s3://u:pw@d/r1/train.parquet", "val_url": "s3://d/r1/val.parquet"}
    files = {
        "train.parquet": {"sha256": "ab" * 32, "num_rows": 10},
        "val.parquet": {"sha256": "cd" * 32, "num_rows": 0},
    }
    (train,) = dataset_inputs(prepared, {"files": files})
    assert (train.dataset.name, train.dataset.digest, train.dataset.source_type) == ("r1/train", "ab" * 8, "s3")
    assert json.loads(train.dataset.source) == {"uri": "s3://u:***@d/r1/train.parquet"}  # credentials masked
    assert [(t.key, t.value) for t in train.tags] == [("mlflow.data.context", "training")]
    assert dataset_inputs({}, {"files": files}) == []  # no URLs: nothing to log
