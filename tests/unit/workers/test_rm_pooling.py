"""Reward-model scores are read at the last attended token, so an EOS equal to the pad id is scored."""

from __future__ import annotations

import pytest
import torch

from workers.reward_model.reward_model_worker import score_at_last_attended_token


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from tests.support.builders import build_tiny_reward_model_dir
    from workers.fsdp import load_hf_model

    path = build_tiny_reward_model_dir(tmp_path_factory.mktemp("rm") / "tiny-rm")
    model = load_hf_model(path, kind="sequence_classification")
    model.eval()
    return model


def _alone(model: torch.nn.Module, ids: list[int]) -> float:
    """The head's score at the last token of ``ids`` forwarded alone (no padding, no pooling)."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
        return float(model.score(hidden)[0, -1, 0])


def test_a_response_ending_in_the_pad_id_is_scored_on_it(reward_model: torch.nn.Module) -> None:
    pad = int(reward_model.config.pad_token_id)
    # Row 0 ends with the pad id as its real last token (pad == eos), then 2 pad columns; row 1 is full.
    rows = [[1, 40, 41, 42, pad], [1, 50, 51, 52, 53, 54, 55]]
    input_ids = torch.tensor([rows[0] + [pad, pad], rows[1]])
    attention_mask = torch.tensor([[1] * 5 + [0, 0], [1] * 7])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 4, 4], list(range(7))])
    with torch.no_grad():
        scores = score_at_last_attended_token(
            reward_model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        hf_pooled = reward_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    expected = [_alone(reward_model, rows[0]), _alone(reward_model, rows[1])]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=0)
    # HF's own pooling skips every pad-id token: row 0 is read one token early (at 42), row 1 agrees.
    assert float(hf_pooled[0, 0]) == pytest.approx(_alone(reward_model, rows[0][:-1]), abs=1e-5)
    assert abs(float(hf_pooled[0, 0]) - expected[0]) > 1e-4
    assert float(hf_pooled[1, 0]) == pytest.approx(expected[1], abs=1e-5)
