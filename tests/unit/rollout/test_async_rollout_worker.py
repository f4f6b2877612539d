"""The async rollout worker (``workers.rollout.async_rollout_worker``) on the tiny model, in this process:
partial rollout continues a generation under newer weights with each token's version and log-prob recorded,
and both weight transports reach the worker.

Notation: B = 4 rows, R = 4 new tokens, pieces of S = 1 token.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from rlhf_ops.config import load_config
from rlhf_ops.padding import compute_position_ids
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from workers.rollout.async_group import AsyncRolloutGroup
from workers.rollout.async_rollout_worker import AsyncRolloutWorker, RolloutWorkerSpec, _Request

EOS = (2,)


def _spec(model_dir: str, **kw: object) -> RolloutWorkerSpec:
    config = load_config("tiny-cpu", ["rollout.max_new_tokens=4", "rollout.temperature=1.0"])
    return RolloutWorkerSpec(
        model_path=model_dir,
        rollout=config.rollout,
        pad_token_id=0,
        eos_token_id=EOS,
        max_prompt_length=4,
        seed=3,
        **kw,  # type: ignore[arg-type]
    )


def _prompts() -> DataProto:
    ids = torch.tensor([[0, 5, 6], [0, 0, 7], [8, 9, 10], [0, 11, 12]])
    mask = (ids != 0).long()
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)},
        non_tensors={"data_source": np.array(["toy"] * 4, dtype=object)},
    )


def _sampling() -> SamplingParams:
    # EOS never sampled: every row runs all R tokens, so every row crosses the weight update.
    return SamplingParams(temperature=1.0, response_length=4, eos_token_id=(83,), pad_token_id=0)


def _scaled(model_dir: str, factor: float) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v * factor if v.is_floating_point() else v for k, v in model.state_dict().items()}


def _token_log_probs(model_dir: str, state: dict[str, torch.Tensor], out: DataProto) -> torch.Tensor:
    """(B, R) log-probs of the responses under ``state``, recomputed by a plain forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    t = out.tensors
    with torch.no_grad():
        logits = model(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
        ).logits.float()
    length = t["responses"].shape[1]
    picked = logits[:, -length - 1 : -1].log_softmax(-1)
    return picked.gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1)


def test_partial_rollout_continues_under_the_new_weights(tiny_model_dir: str) -> None:
    worker = AsyncRolloutWorker(_spec(tiny_model_dir, partial_rollout=True, partial_rollout_tokens=1))
    worker.stop()
    worker._thread.join(timeout=5)
    old = _scaled(tiny_model_dir, 1.0)
    new = _scaled(tiny_model_dir, 1.5)
    worker.push_weights(new, 1)  # pending: taken at the first piece boundary, after token 0
    out = worker._generate(_Request("1/0", _prompts(), _sampling(), 0))
    versions = out.tensors["token_policy_version"]
    assert versions[:, 0].tolist() == [0, 0, 0, 0]
    assert versions[:, 1:].unique().tolist() == [1]
    assert worker.version == 1 and worker.stats()["cuts"] == 1.0
    recorded = out.tensors["rollout_log_probs"]
    under_old, under_new = _token_log_probs(tiny_model_dir, old, out), _token_log_probs(tiny_model_dir, new, out)
    torch.testing.assert_close(recorded[:, 0], under_old[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(recorded[:, 1:], under_new[:, 1:], atol=1e-4, rtol=1e-4)
    assert (recorded[:, 1:] - under_old[:, 1:]).abs().max() > 1e-2  # the two policies do differ
    assert list(out.non_tensor_batch["data_source"]) == ["toy"] * 4


def test_without_partial_rollout_a_request_keeps_its_weights(tiny_model_dir: str) -> None:
    worker = AsyncRolloutWorker(_spec(tiny_model_dir, partial_rollout=False))
    worker.stop()
    worker._thread.join(timeout=5)
    worker.push_weights(_scaled(tiny_model_dir, 1.5), 1)
    out = worker._generate(_Request("1/0", _prompts(), _sampling(), 0))
    assert out.tensors["token_policy_version"].unique().tolist() == [0] and worker.version == 0


def test_group_streams_requests_and_waits_for_their_weights(tiny_model_dir: str) -> None:
    group = AsyncRolloutGroup.local(_spec(tiny_model_dir), num_workers=2)
    try:
        parts = group.submit(7, _prompts(), _sampling(), n=2, min_version=1, front=False)
        assert parts == 2
        assert group.poll(0.3) == []  # min_version 1: no worker starts with version 0
        group.push_weights(_scaled(tiny_model_dir, 1.5), 1)
        found: list[tuple[int, int, DataProto]] = []
        while len(found) < 2:
            found += group.poll(5.0)
        assert sorted((b, p, len(d)) for b, p, d in found) == [(7, 0, 2), (7, 1, 2)]
        assert all(d.tensors["token_policy_version"].max().item() == 1 for _, _, d in found)
        assert all(s["version"] == 1.0 for s in group.stats())
    finally:
        group.shutdown()


def test_remote_store_transport_keeps_one_file(tiny_model_dir: str, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/weights"
    group = AsyncRolloutGroup.local(_spec(tiny_model_dir), weight_transport="remote_store", weight_store_url=url)
    try:
        for version in (1, 2):
            group.push_weights(_scaled(tiny_model_dir, 1.0 + version), version)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["policy_v2.safetensors"]
        worker = group.workers[0]
        deadline = time.monotonic() + 5
        while worker.version != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.version == 2
        param = dict(worker.engine.module.named_parameters())["model.embed_tokens.weight"]
        torch.testing.assert_close(param, _scaled(tiny_model_dir, 3.0)["model.embed_tokens.weight"])
    finally:
        group.shutdown()
