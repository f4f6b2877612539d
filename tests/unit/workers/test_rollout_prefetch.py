"""RolloutPrefetch: one rollout generating on a background thread while the caller goes on (one-step off-policy).

The engine here is a minimal stand-in for the engine Protocol (it echoes the prompts after a gate opens), so the
test controls when "generation" finishes; the real async vLLM engine runs through it in
tests/integration/test_one_step_off_training.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from workers.rollout.prefetch import RolloutPrefetch


class GatedEngine:
    """Generates ``responses = input_ids + 1`` once ``gate`` is set; records the thread it ran on."""

    def __init__(self, *, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.thread: str | None = None
        self.calls: list[tuple[SamplingParams | None, int | None]] = []
        self.fail = fail

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        self.thread = threading.current_thread().name
        self.calls.append((sampling, step))
        assert self.gate.wait(10)
        if self.fail:
            raise ValueError("engine core died")
        ids = prompts.tensors["input_ids"]
        return DataProto.from_dict(
            {"input_ids": ids, "responses": ids + 1}, meta_info={"timing": {"generate_sequences": 0.25}}
        )


def _prompts(rows: int, offset: int = 0) -> DataProto:
    return DataProto.from_dict({"input_ids": torch.arange(rows * 3).reshape(rows, 3) + offset})


def test_submit_returns_before_the_rollout_ends_and_collect_returns_it_with_the_timings() -> None:
    engine, prefetch = GatedEngine(), RolloutPrefetch()
    sampling = SamplingParams(temperature=0.5)
    receipt = prefetch.submit(engine, _prompts(4), sync_s=0.125, sampling=sampling, step=7)
    assert receipt.tensors["submitted"].tolist() == [True] * 4  # returned while the engine still waits
    assert receipt.meta_info["timing"] == {"update_weights": 0.125}
    opener = threading.Timer(0.2, engine.gate.set)
    opener.start()
    out = prefetch.collect(_prompts(4))
    assert engine.thread == "rollout-prefetch" and engine.calls == [(sampling, 7)]
    assert torch.equal(out.tensors["responses"], _prompts(4).tensors["input_ids"] + 1)
    timing = out.meta_info["timing"]
    assert timing["generate_sequences"] == 0.25 and timing["update_weights"] == 0.125
    assert 0.1 < timing["generate_wait"] < 5  # collect waited for the gate
    engine.gate.clear()
    prefetch.submit(engine, _prompts(2), sync_s=0.0)  # collected: a new submit is allowed
    engine.gate.set()
    assert len(prefetch.collect(_prompts(2))) == 2


def test_a_second_submit_before_collect_and_a_collect_without_submit_are_refused() -> None:
    engine, prefetch = GatedEngine(), RolloutPrefetch()
    with pytest.raises(RuntimeError, match="no rollout was submitted"):
        prefetch.collect(_prompts(2))
    prefetch.submit(engine, _prompts(2), sync_s=0.0)
    with pytest.raises(RuntimeError, match="previous rollout was not collected"):
        prefetch.submit(engine, _prompts(2), sync_s=0.0)
    engine.gate.set()
    prefetch.collect(_prompts(2))


def test_other_rows_at_collect_and_an_engine_error_are_raised_on_the_caller_s_thread() -> None:
    engine, prefetch = GatedEngine(), RolloutPrefetch()
    engine.gate.set()
    prefetch.submit(engine, _prompts(2), sync_s=0.0)
    with pytest.raises(RuntimeError, match="rows differ from the submitted ones"):
        prefetch.collect(_prompts(2, offset=100))
    failing = GatedEngine(fail=True)
    failing.gate.set()
    prefetch.submit(failing, _prompts(2), sync_s=0.0)  # the failed collect above cleared the slot
    with pytest.raises(ValueError, match="engine core died"):
        prefetch.collect(_prompts(2))
