"""prepare_dataset reading raw shards from, and writing its run folder to, a real S3 endpoint (moto's server)."""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest

from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.data.prepare import PrepareSpec, prepare_dataset
from rlhf_ops.models.resolve import resolve_model_path
from tests.support.moto_server import MotoServer, running_moto_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto_server() as server:
        yield server


@pytest.fixture
def bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import s3fs

    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # no client cached with another endpoint
    yield moto.create_bucket(f"data-{uuid.uuid4().hex[:12]}")
    s3fs.S3FileSystem.clear_instance_cache()


def test_prepare_from_and_to_s3(moto: MotoServer, bucket: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-llama"))
    client = moto.client()
    rows = [{"prompt": f"{i // 10}+{i % 10}=", "ground_truth": str(i // 10 + i % 10)} for i in range(40)]
    parquet = io.BytesIO()
    pd.DataFrame(rows[:20]).to_parquet(parquet, index=False)
    client.put_object(Bucket=bucket, Key="raw/part-0.parquet", Body=parquet.getvalue())
    jsonl = "".join(json.dumps(r) + "\n" for r in rows[20:]) + "{broken\n"
    client.put_object(Bucket=bucket, Key="raw/part-1.jsonl", Body=jsonl.encode())

    spec = PrepareSpec(source=f"s3://{bucket}/raw", prompt_format="chat", max_prompt_length=16, val_fraction=0.25)
    result = prepare_dataset(spec, out_url=f"s3://{bucket}/prepared", run_id="run-1", tokenizer=tokenizer)
    assert (result.num_train + result.num_val, result.num_rejected) == (40, 1)
    assert result.train_url == f"s3://{bucket}/prepared/run-1/train.parquet"

    def read(name: str) -> bytes:
        return bytes(client.get_object(Bucket=bucket, Key=f"prepared/run-1/{name}")["Body"].read())

    manifest: dict[str, Any] = json.loads(read("manifest.json"))
    files = {name: read(name) for name in ("train.parquet", "val.parquet", "rejected.jsonl")}
    assert {n: hashlib.sha256(b).hexdigest() for n, b in files.items()} == {
        n: entry["sha256"] for n, entry in manifest["files"].items()
    }
    (record,) = [json.loads(line) for line in files["rejected.jsonl"].decode().splitlines()]
    assert (record["source"], record["row_index"], record["kind"]) == (
        f"s3://{bucket}/raw/part-1.jsonl",
        20,
        "invalid_json",
    )

    dataset = PromptDataset.from_sources([result.train_url], tokenizer, max_prompt_length=16)
    assert len(dataset) == result.num_train and {len(ids) for ids in dataset.prompt_ids} == {8}  # 1+(1+4+1)+1

    again = prepare_dataset(spec, out_url=f"s3://{bucket}/prepared", run_id="run-1", tokenizer=tokenizer)
    assert again == result
    assert {name: read(name) for name in files} == files  # a retry rewrites the same bytes
