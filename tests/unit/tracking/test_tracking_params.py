"""Flattening, key sanitising, redaction, overflow and batching of MLflow params (no server)."""

from __future__ import annotations

import posixpath

import pytest

from rlhf_ops.tracking import params as P


def test_limits_match_installed_mlflow() -> None:
    from mlflow.utils import validation as v

    assert P.MAX_PARAMS_TAGS_PER_BATCH == v.MAX_PARAMS_TAGS_PER_BATCH == 100
    assert P.MAX_METRICS_PER_BATCH == v.MAX_METRICS_PER_BATCH == 1000
    assert v.MAX_ENTITIES_PER_BATCH >= max(P.MAX_METRICS_PER_BATCH, P.MAX_PARAMS_TAGS_PER_BATCH)  # one kind a batch
    assert P.MAX_PARAM_VALUE_LENGTH == v.MAX_PARAM_VAL_LENGTH == 6000
    assert P.MAX_TAG_VALUE_LENGTH == v.MAX_TAG_VAL_LENGTH == 8000
    assert P.MAX_KEY_LENGTH == v.MAX_ENTITY_KEY_LENGTH == 250


def test_flatten_config_dotted_keys_and_json_values() -> None:
    cfg = {"actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.95]}, "use_kl": True}, "name": "x", "extra": {}, "n": None}
    assert P.flatten_config(cfg) == {
        "actor.optim.lr": "1e-06",
        "actor.optim.betas": "[0.9, 0.95]",
        "actor.use_kl": "true",
        "name": "x",
        "extra": "{}",
        "n": "null",
    }


def test_flatten_config_accepts_pydantic_models() -> None:
    import pydantic

    class Optim(pydantic.BaseModel):
        lr: float = 0.5

    class Cfg(pydantic.BaseModel):
        optim: Optim = Optim()
        steps: int = 3

    assert P.flatten_config(Cfg()) == {"optim.lr": "0.5", "steps": "3"}


def test_flatten_config_rejects_non_mapping() -> None:
    with pytest.raises(ValueError, match="must be a mapping"):
        P.flatten_config([1, 2])


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("actor/pg_loss", "actor/pg_loss"),
        ("val-core/gsm8k/acc@1", "val-core/gsm8k/acc_1"),
        ("/a//b/", "a/b"),
        ("a/./b/../c", "a/_/b/__/c"),
        ("lr:warmup (steps)", "lr_warmup _steps_"),
        ("", "_"),
        ("ü", "_"),
    ],
)
def test_sanitize_key(key: str, expected: str) -> None:
    assert P.sanitize_key(key) == expected


def test_sanitize_key_long_keys_stay_distinct_and_valid() -> None:
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    sa, sb = P.sanitize_key(a), P.sanitize_key(b)
    assert len(sa) == len(sb) == 250  # 241 kept chars + "-" + 8 hex digits
    assert sa != sb and sa.startswith("x" * 241) and posixpath.normpath(sa) == sa


def test_sanitize_keys_collision_names_both_keys() -> None:
    with pytest.raises(ValueError, match=r"'a@b' and 'a#b' both map to MLflow name 'a_b'"):
        P.sanitize_keys({"a@b": 1, "a#b": 2}, what="log_metrics")


@pytest.mark.parametrize(
    "key",
    [
        "storage.password",
        "hf.token",
        "s3.aws_secret_access_key",
        "s3.access_key_id",
        "openai.api_key",
        "openai.apikey",
        "db.credentials.user",  # everything below a secret segment
        "github_token",
        "signing_key",
        "client-secret",
        "key",
    ],
)
def test_secret_keys_are_detected(key: str) -> None:
    assert P.is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "data.prompt_key",
        "data.reward_fn_key",
        "tokenizer.pad_token",
        "tokenizer.eos_token",
        "rollout.max_num_batched_tokens",
        "rollout.max_new_tokens",
        "data.max_prompt_tokens",
        "actor.ppo_max_token_len_per_gpu",
        "data.tokenizer",
        "keyword",
        "monkey_count",
    ],
)
def test_ordinary_keys_are_not_secret(key: str) -> None:
    assert not P.is_secret_key(key)


def test_redact_params_keys_and_values() -> None:
    out = P.redact_params(
        {
            "hf.token": "hf_abc",
            "db.url": "postgresql://airflow:s3cr3t@db:5432/airflow",
            "note": "token hf_" + "a" * 34 + " and key AKIA" + "B" * 16,
            "lr": "1e-06",
        }
    )
    assert out == {
        "hf.token": P.REDACTED,
        "db.url": "postgresql://airflow:***@db:5432/airflow",
        "note": "token *** and key ***",
        "lr": "1e-06",
    }


def test_redact_config_keeps_shape_and_hides_subtrees() -> None:
    cfg = {"storage": {"url": "s3://k:v@minio:9000/b", "credentials": {"key": "k", "secret": "v"}}, "ids": [1, "x"]}
    assert P.redact_config(cfg) == {
        "storage": {"url": "s3://k:***@minio:9000/b", "credentials": P.REDACTED},
        "ids": [1, "x"],
    }


def test_split_overflow_replaces_long_values_by_a_pointer() -> None:
    long = "y" * 6001  # one char over MLflow's 6000 limit
    kept, overflow = P.split_overflow({"short": "y" * 6000, "long": long})
    assert kept["short"] == "y" * 6000
    assert overflow == {"long": long}
    assert kept["long"].startswith("<in params_overflow.json: 6001 chars, sha256 ")
    assert len(kept["long"]) < 100


def test_prepare_params_runs_every_step() -> None:
    params, overflow = P.prepare_params({"a@b": {"password": "pw", "doc": "z" * 7000, "n": 2}})
    assert params["a_b.password"] == P.REDACTED
    assert params["a_b.n"] == "2"
    assert overflow == {"a_b.doc": "z" * 7000}


def test_chunked_250_params_make_3_batches() -> None:
    batches = P.chunked(list(range(250)), P.MAX_PARAMS_TAGS_PER_BATCH)
    assert [len(b) for b in batches] == [100, 100, 50]
    assert sum(batches, []) == list(range(250))


def test_chunked_2500_metrics_make_3_batches_and_empty_makes_none() -> None:
    assert [len(b) for b in P.chunked(list(range(2500)), P.MAX_METRICS_PER_BATCH)] == [1000, 1000, 500]
    assert P.chunked([], 100) == []
    with pytest.raises(ValueError, match="size must be >= 1"):
        P.chunked([1], 0)
