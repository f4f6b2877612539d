"""GQA (9 query / 3 kv heads) under remove padding on the real SmolLM2-135M-Instruct, pad == eos.

The batch is what a rollout of the real model looks like: chat-templated prompts left-padded with id 2
(which is also the ``<|im_end|>`` closing each turn inside the prompt), responses that end with EOS (2)
followed by pad (2). Packing must use the masks only, never ``ids != pad``, so the packed log-probs equal
the padded forward's on every response token, the ending EOS included.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig
from rlhf_ops.data.dataset import PromptDataset, encode_prompt
from rlhf_ops.padding import build_full_sequence, get_response_mask
from rlhf_ops.protocol import DataProto
from tests.support.real_model import smollm2_path
from tests.unit.workers.fsdp_test_batch import make_plan
from workers.actor import DataParallelPPOActor
from workers.fsdp import build_device_mesh, build_fsdp_model

EOS = PAD = 2


def _batch(tokenizer: Any) -> DataProto:
    questions = ["Hi", "What is the capital of France?", "Name two colours.", "2+2?"]
    ids = [encode_prompt([{"role": "user", "content": q}], tokenizer, apply_chat_template=True) for q in questions]
    dataset = PromptDataset(ids, questions, [""] * 4, ["t"] * 4)
    prompts = dataset.batch(list(range(4)), pad_token_id=PAD, uid_prefix="p")
    answers = ["Hello!", "Paris.", "Red and blue, two colours.", "4"]
    rows = [tokenizer(a, add_special_tokens=False)["input_ids"] + [EOS] for a in answers]
    width = max(len(r) for r in rows) + 1
    responses = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])  # (4, R): EOS, then pad == EOS
    response_mask = get_response_mask(responses, eos_token_id=EOS)
    full = build_full_sequence(
        prompts.tensors["input_ids"],
        prompt_mask=prompts.tensors["attention_mask"],
        responses=responses,
        response_mask=response_mask,
    )
    return DataProto.from_dict({"responses": responses, "response_mask": response_mask, **full})


def test_packed_log_probs_equal_padded_ones_on_the_real_model(gloo_world1: None) -> None:
    from transformers import AutoTokenizer

    path = smollm2_path()
    data = _batch(AutoTokenizer.from_pretrained(path))
    model = build_fsdp_model(path, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu")
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    mask = data.tensors["response_mask"]
    assert mask.sum(-1).tolist() == [
        int(r.eq(EOS).nonzero()[0]) + 1 for r in data.tensors["responses"]
    ]  # each row's EOS is its last valid token
    plan = make_plan(log_prob_micro=4)
    padded = DataParallelPPOActor(model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=plan)
    packed = DataParallelPPOActor(
        model, config=ActorConfig(use_remove_padding=True), algorithm=AlgorithmConfig(), plan=plan
    )
    lp_pad, _ = padded.compute_log_prob(data)
    lp_pack, _ = packed.compute_log_prob(data)
    keep = mask.bool()
    torch.testing.assert_close(lp_pack[keep], lp_pad[keep], atol=1e-4, rtol=0)
    # A pretrained model finds its own short answers likely and EOS after them plausible: far from uniform
    # (log(1/49152) = -10.8), which a broken mask (pads attended, EOS shifted) would not give.
    assert lp_pad[keep].mean() > -4.0
