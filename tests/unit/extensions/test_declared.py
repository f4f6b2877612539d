"""Built-in entries declared by a decorator on their function: read from the source (no import), equal to what
the decorator builds when the module is imported, and a new one is one function in one file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from rlhf_ops.extensions.algorithms import AdvantageEstimator, PolicyLoss, advantage_estimator
from rlhf_ops.extensions.declared import declarations
from rlhf_ops.extensions.rewards import REWARD_FUNCTIONS
from rlhf_ops.extensions.table import Table

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def tmp_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable package ``decl_pkg`` under ``tmp_path`` (removed from ``sys.modules`` afterwards)."""
    package = tmp_path / "decl_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m == "decl_pkg" or m.startswith("decl_pkg.")]:
        del sys.modules[name]


def test_builtin_names_are_read_without_importing_their_modules() -> None:
    code = (
        "import sys; from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES; "
        "from rlhf_ops.extensions.rewards import REWARD_FUNCTIONS; "
        "print(len(list(ADVANTAGE_ESTIMATORS)), len(list(POLICY_LOSSES)), len(list(KL_ESTIMATORS)), "
        "len(list(REWARD_FUNCTIONS)), 'torch' in sys.modules, 'rlhf_ops.algorithms' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["6", "5", "14", "10", "False", "False"]


def test_the_scan_equals_the_decorators_at_import() -> None:
    import rlhf_ops.algorithms  # noqa: F401  (every decorator runs; a differing entry would raise here)
    import rlhf_ops.rewards.registry  # noqa: F401

    grpo = ADVANTAGE_ESTIMATORS.known("grpo")
    assert grpo == AdvantageEstimator(
        name="grpo",
        target="rlhf_ops.algorithms.advantages:compute_grpo_outcome_advantage",
        description="Score minus the group mean, over the group std (Dr.GRPO without the std).",
        group=True,
        config_params=("norm_adv_by_std_in_grpo",),
    )
    assert POLICY_LOSSES.builtin_names()[0] == "vanilla"  # the default first (the schema lists them in order)
    assert POLICY_LOSSES.known("clip_cov") == PolicyLoss(
        name="clip_cov",
        target="rlhf_ops.algorithms.policy_losses.covariance:compute_policy_loss_clip_cov",
        description="Clip-Cov: drops the loss of a few high-covariance tokens.",
        config_params=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
        seeded=True,
    )
    k3 = KL_ESTIMATORS.known("k3+")
    assert k3 is not None and k3.straight_through and k3.target == "rlhf_ops.algorithms.kl:kl_k3"
    assert REWARD_FUNCTIONS.known("gsm8k_flexible") is not None
    # the scan reads every decorator of the module, in source order
    names = [d.args[0] for d in declarations("rlhf_ops.algorithms.advantages", "advantage_estimator")]
    assert names == ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]


def test_a_new_builtin_is_one_function_in_one_file(tmp_package: Path) -> None:
    (tmp_package / "adv.py").write_text(
        textwrap.dedent(
            '''
            from rlhf_ops.extensions.algorithms import advantage_estimator


            @advantage_estimator("halved", group=True)
            def halved(token_level_rewards, response_mask, index):
                """Half the reward (a test's estimator)."""
                return token_level_rewards / 2, token_level_rewards / 2
            '''
        )
    )
    from rlhf_ops.extensions.algorithms import _advantage_entries

    table: Table[AdvantageEstimator] = Table(
        what="advantage estimator",
        key="algorithm.adv_estimator",
        entry_type=AdvantageEstimator,
        group="decl_pkg.none",
        from_callable=None,
        declared_in=("decl_pkg.*",),
        decorator="advantage_estimator",
        build=_advantage_entries,
    )
    entry = table.get("halved")
    assert (entry.target, entry.group, entry.description) == (
        "decl_pkg.adv:halved",
        True,
        "Half the reward (a test's estimator).",
    )
    assert "decl_pkg.adv" not in sys.modules  # read, not imported
    try:  # importing it runs the decorator, which registers the name in the global table too
        assert entry.load()(token_level_rewards=4.0, response_mask=None, index=None) == (2.0, 2.0)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("halved")


def test_a_decorated_function_outside_the_package_registers_on_import(tmp_package: Path) -> None:
    (tmp_package / "plugin.py").write_text(
        textwrap.dedent(
            """
            from rlhf_ops.extensions.algorithms import advantage_estimator


            @advantage_estimator("decl_test_plugin", needs_critic=True)
            def with_values(token_level_rewards, response_mask, values):
                return values, values
            """
        )
    )
    assert ADVANTAGE_ESTIMATORS.known("decl_test_plugin") is None
    try:
        import decl_pkg.plugin  # noqa: F401

        entry = ADVANTAGE_ESTIMATORS.get("decl_test_plugin")
        assert (entry.target, entry.needs_critic, entry.group) == ("decl_pkg.plugin:with_values", True, False)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("decl_test_plugin")


def test_a_name_declared_twice_is_refused() -> None:
    def other(token_level_rewards: object, response_mask: object, index: object) -> tuple[object, object]:
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match="advantage estimator 'grpo' is declared as .* give one of them another name"):
        advantage_estimator("grpo", group=True)(other)


def test_a_non_literal_argument_is_one_line(tmp_package: Path) -> None:
    (tmp_package / "bad.py").write_text(
        "from rlhf_ops.extensions.algorithms import advantage_estimator\n\n"
        "NAME = 'x'\n\n\n@advantage_estimator(NAME)\ndef bad(token_level_rewards, response_mask):\n    return 0, 0\n"
    )
    with pytest.raises(
        ValueError, match=r"bad\.py:6 @advantage_estimator: the decorator's arguments must be literals"
    ):
        list(declarations("decl_pkg.bad", "advantage_estimator"))
