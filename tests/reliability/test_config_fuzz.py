"""Seeded fuzz of bad values over every config key (keys derived from the schema): no crash, one line per refusal.

Each case sets one key of the ``tiny-cpu`` preset to a hostile value, written as a user would type it on the
command line (``key=value``, parsed as YAML like every override). The outcome is either a :class:`ConfigError`
whose every problem is one line naming the key (or a key under it) and a fix, or an accepted config that dumps,
reloads equal and derives its batch plan. Anything else (another exception, a multi-line message) is a crash.
"""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from pydantic import BaseModel

from rlhf_ops.config import ConfigError, RunConfig, load_config
from rlhf_ops.config.batch_plan import derive_batch_plan
from rlhf_ops.config.loader import apply_overrides, dump_config, read_preset
from tests.reliability.conftest import Figures

MAX_LINE = 1000  # a refusal quotes the value; a 100k-character value must not become a 100k-character line

FIXED_VALUES = [
    "",
    " ",
    "null",
    "~",
    "-1",
    "0",
    "-0.0",
    "1",
    "1e309",
    "-1e309",
    ".nan",
    ".inf",
    "-.inf",
    "99999999999999999999999",
    "true",
    "false",
    "yes",
    "[]",
    "[1, 2]",
    "[[[]]]",
    "{}",
    "{a: 1}",
    "'../../x'",
    "../../etc",
    "/etc/passwd",
    '"a\\0b"',
    '"line1\\nline2"',
    '"\\x1b[31mred"',
    "'\u202eevil'",
    "2026-12-01",
    "!!binary aGVsbG8=",
    "!!python/object/apply:os.system [echo pwned]",
    "&a [*a]",
    "*undefined",
    "[unclosed",
    "{: }",
    "a: b: c",
    "'%s%s%s%n'",
    "'{0.__class__}'",
    "$(rm -rf /)",
    "'; DROP TABLE runs; --",
    "x" * 100_000,
    "'" + "é" * 300 + "'",
]


def leaf_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (a field whose type is a section is walked into)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def random_value(rng: random.Random) -> str:
    """A hostile value: one of the fixed ones, or random text (printable, control characters, unicode)."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(FIXED_VALUES)
    alphabet = {
        1: string.printable,
        2: "".join(map(chr, range(0, 32))) + "./\\'\"[]{}:,#&*!|>%@`",
        3: "".join(chr(rng.randrange(0x80, 0x2FFF)) for _ in range(64)),
    }[kind]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))


def _names_key(problems: list[Any], key: str, override: str) -> bool:
    """A problem names ``key`` (or a key under it); a cross-field refusal (the value alone is valid) may name
    the other key of the rule instead (``reward.overlong_buffer.enable=true`` needs ``...len`` >= 1)."""
    if any(p.key == key or p.key.startswith(f"{key}.") for p in problems):
        return True
    try:
        RunConfig.model_validate(apply_overrides(read_preset("tiny-cpu"), [override]))
    except Exception:
        return False
    return True


def run_fuzz(n: int, *, seed: int) -> dict[str, Any]:
    """Fuzz ``n`` (key, value) cases; returns the counts and the offending cases (empty when all is well)."""
    rng = random.Random(seed)
    keys = leaf_keys()
    counts = {"cases": n, "keys": len(keys), "refused": 0, "accepted": 0, "crashes": 0, "bad_messages": 0}
    offending: list[str] = []
    accepted: list[str] = []
    for _ in range(n):
        key, value = rng.choice(keys), random_value(rng)
        override = f"{key}={value}"
        try:
            run = load_config("tiny-cpu", [override])
            assert load_config("tiny-cpu", [f"{key}={value}"]) == run
            assert RunConfig.model_validate_json(run.model_dump_json()) == run, dump_config(run)
            derive_batch_plan(run)
        except ConfigError as exc:
            counts["refused"] += 1
            lines = [str(p) for p in exc.problems]
            if not (
                lines
                and _names_key(exc.problems, key, override)
                and all("\n" not in line and "\r" not in line and len(line) <= MAX_LINE for line in lines)
                and all(p.fix for p in exc.problems)
            ):
                counts["bad_messages"] += 1
                offending.append(f"{override[:120]!r} -> {[line[:200] for line in lines]}")
            continue
        except Exception as exc:  # a crash: what the suite exists to find
            counts["crashes"] += 1
            offending.append(f"{override[:120]!r} -> {type(exc).__name__}: {str(exc)[:300]}")
            continue
        counts["accepted"] += 1
        accepted.append(override[:80])
    return {**counts, "offending": offending, "accepted_examples": accepted[:20]}


def test_every_schema_key_is_reached() -> None:
    keys = leaf_keys()
    # Hand-picked keys from every section (the walk must reach nested sections like actor.fsdp.mixed_precision).
    expected = ["model.lora.rank", "actor.fsdp.mixed_precision.param_dtype", "trainer.run_name", "tracking.experiment"]
    assert set(expected) <= set(keys)
    assert len(keys) > 130 and len(set(keys)) == len(keys)


def test_fuzzed_bad_values_are_refused_in_one_line_naming_the_key(figures: Figures) -> None:
    result = run_fuzz(300, seed=15)
    figures.record(**{k: v for k, v in result.items() if k != "offending"})
    assert result["crashes"] == 0 and result["bad_messages"] == 0, "\n".join(result["offending"])
    assert result["refused"] + result["accepted"] == 300 and result["refused"] > 200


@pytest.mark.slow
def test_fuzz_3000_values(figures: Figures) -> None:
    result = run_fuzz(3000, seed=1515)
    figures.record(**{k: v for k, v in result.items() if k != "offending"})
    assert result["crashes"] == 0 and result["bad_messages"] == 0, "\n".join(result["offending"])


@pytest.mark.parametrize("override", ["critic.optim.lr=yes", "trainer.keep_last=true", "data.val_batch_size=on"])
def test_a_boolean_is_not_a_number(override: str) -> None:
    """Found by the fuzz: pydantic's lax mode read YAML's ``yes`` as 1 (a learning rate of 1.0)."""
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", [override])
    key = override.partition("=")[0]
    assert [str(p) for p in caught.value.problems] == [
        f"{key}: is a boolean where a number is meant (got True). Fix: set a number"
    ]
    assert load_config("tiny-cpu", ["model.lora.rank=0", "trainer.val_before_train=yes"]).trainer.val_before_train


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # The sections of their own modules (multi-turn, async trainer, rollout correction) did not derive from the
        # schema's Section, so they took an infinite float and a boolean as a number.
        ("rollout.multi_turn.tool_timeout_s=1e309", "Input should be a finite number (got '1e309')"),
        ("rollout.multi_turn.max_turns=true", "is a boolean where a number is meant (got True)"),
        ("trainer.async_rollout.max_staleness=yes", "is a boolean where a number is meant (got True)"),
        ("algorithm.rollout_correction.rollout_is_threshold=.nan", "Input should be a finite number (got nan)"),
        # verl's logger converter iterated over whatever it got: a number crashed it (TypeError).
        ("trainer.logger=-.inf", "Input should be a valid list (got -inf)"),
    ],
)
def test_found_by_the_fuzz_a_sub_section_or_a_converter_refuses_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", [override])
    key = override.partition("=")[0]
    (problem,) = caught.value.problems
    assert problem.key == key and problem.message.startswith(message), str(problem)
