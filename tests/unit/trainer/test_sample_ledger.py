"""The per-sample ledger: counts and an order-independent digest that a drop or a duplicate changes, through
its checkpoint state."""

from __future__ import annotations

from rlhf_ops.trainer.sample_ledger import SampleLedger


def _run(steps: list[list[str]], *, resume_after: int | None = None) -> list[dict[str, float]]:
    ledger, out = SampleLedger(), []
    for i, ids in enumerate(steps):
        out.append(ledger.record(ids))
        if resume_after == i:  # a checkpoint, then a fresh process restoring it
            state = ledger.state_dict()
            ledger = SampleLedger()
            ledger.load_state_dict(state)
    return out


STEPS = [["e0-3", "e0-3", "e0-1"], ["e0-0", "e0-2"], ["e1-2", "e1-0"]]  # a group of 2 responses shares "e0-3"


def test_counts_distinct_ids_per_step_and_continues_through_a_resume() -> None:
    plain = _run(STEPS)
    assert [m["samples/step_count"] for m in plain] == [2.0, 2.0, 2.0]
    assert [m["samples/consumed_total"] for m in plain] == [2.0, 4.0, 6.0]
    assert _run(STEPS, resume_after=1) == plain
    assert _run([list(reversed(s)) for s in STEPS]) == plain  # the order within a step does not matter


def test_a_dropped_or_duplicated_sample_changes_the_digest() -> None:
    want = _run(STEPS)[-1]
    dropped = _run([STEPS[0], ["e0-0"], STEPS[2]])[-1]
    twice = _run([STEPS[0], STEPS[1], ["e1-2", "e0-0"]])[-1]  # e0-0 trained again instead of e1-0
    assert dropped["samples/consumed_digest"] != want["samples/consumed_digest"]
    assert twice["samples/consumed_total"] == want["samples/consumed_total"]  # the count alone misses it
    assert twice["samples/consumed_digest"] != want["samples/consumed_digest"]


def test_a_checkpoint_without_a_ledger_restarts_the_count() -> None:
    ledger = SampleLedger()
    ledger.load_state_dict(None)
    assert ledger.record(["a"])["samples/consumed_total"] == 1.0
