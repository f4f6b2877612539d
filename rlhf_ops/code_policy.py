"""Which Python modules user-named code (reward functions, rollout tools) may be imported from.

A config names code by dotted path (``reward.reward_fn=my_pkg.rewards:score``), and the trigger form of a
pipeline is a config. Importing a module runs it, so only modules under a prefix the platform operator allows
are imported; built-ins are always allowed. The operator sets the allow-list, never the run's config:

- ``RLHF_ALLOWED_CODE_MODULES``: comma-separated module prefixes (``my_pkg,team_rewards.v2``), or ``*`` (any);
- the platform file (``$RLHF_PLATFORM_CONFIG``, default ``/etc/rlhf-ops/platform.yaml``) with
  ``allowed_code_modules: [my_pkg, team_rewards.v2]``.

Both are read where the code is imported (the Airflow worker's pre-flight and the Ray job), so set them on
both (the images' environment or the same platform file). Code a pipeline ships with its run (``py_modules``
under the spec's ``code``, governed by :mod:`rlhf_ops.pipeline.override_policy`) is allowed in that run's Ray jobs
(``$RLHF_SHIPPED_MODULES``, set by the operator, never by the form). A prefix matches the module itself and its
submodules: ``my_pkg`` allows ``my_pkg`` and ``my_pkg.rewards``, not ``my_pkg_evil``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import yaml

ALLOWED_MODULES_ENV = "RLHF_ALLOWED_CODE_MODULES"
SHIPPED_MODULES_ENV = "RLHF_SHIPPED_MODULES"  # set on a pipeline's Ray jobs by the provider's operator
PLATFORM_CONFIG_ENV = "RLHF_PLATFORM_CONFIG"
DEFAULT_PLATFORM_CONFIG = "/etc/rlhf-ops/platform.yaml"
BUILTIN_PREFIXES = ("rlhf_ops",)


class CodeNotAllowedError(ValueError):
    """A dotted path names a module outside the operator's allow-list; the message says how to allow it."""


def _platform_file_prefixes() -> list[str]:
    path = Path(os.environ.get(PLATFORM_CONFIG_ENV) or DEFAULT_PLATFORM_CONFIG)
    if not path.is_file():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    entries = data.get("allowed_code_modules") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise CodeNotAllowedError(
            f"{path}: allowed_code_modules must be a list of module prefixes (e.g. [my_pkg]); fix the platform file"
        )
    return entries


def allowed_prefixes() -> tuple[str, ...]:
    """The built-in prefixes plus the operator's (``*`` allows any module)."""
    extra = [p for p in os.environ.get(ALLOWED_MODULES_ENV, "").split(",") if p.strip()]
    # The modules a pipeline run ships (py_modules): its spec, or what the spec lets the form ship, allowed them.
    extra += [p for p in os.environ.get(SHIPPED_MODULES_ENV, "").split(",") if p.strip()]
    extra += _platform_file_prefixes()
    return (*BUILTIN_PREFIXES, *dict.fromkeys(p.strip().rstrip(".") for p in extra))


def is_allowed(module: str, prefixes: tuple[str, ...] | None = None) -> bool:
    """Whether ``module`` (``pkg.sub``) is under one of ``prefixes`` (default :func:`allowed_prefixes`)."""
    prefixes = allowed_prefixes() if prefixes is None else prefixes
    return any(p == "*" or module == p or module.startswith(f"{p}.") for p in prefixes)


def check_code_allowed(module: str, *, what: str) -> None:
    """Raises :class:`CodeNotAllowedError` unless ``module`` may be imported for ``what`` (``reward function
    'x:f'``, ``tool 'y:T'``)."""
    prefixes = allowed_prefixes()
    if is_allowed(module, prefixes):
        return
    raise CodeNotAllowedError(
        f"{what}: module {module!r} is not on the platform's allow-list of code modules ({', '.join(prefixes)}); "
        f"use a built-in, or ask the platform operator to add its package to {ALLOWED_MODULES_ENV} or to "
        f"allowed_code_modules in the platform file (${PLATFORM_CONFIG_ENV}, default {DEFAULT_PLATFORM_CONFIG})"
    )


def split_dotted(spec: str) -> tuple[str, str]:
    """``(module, attribute path)`` of ``"pkg.module:attr"`` or ``"pkg.module.attr"`` (either part may be empty).

    After a ``:`` the attribute path may itself be dotted (``"pkg.mod:Class.method"``); without one the last
    dotted name is the attribute.
    """
    module, _, attr_path = spec.partition(":") if ":" in spec else spec.rpartition(".")
    return module, attr_path


def import_dotted(spec: str, *, what: str, example: str, builtins: list[str] | None = None) -> Any:
    """The object a dotted-path spec names, imported only when its module is on the allow-list.

    The one resolver of user-named code (reward functions, rollout tools and interactions), so every kind
    goes through :func:`check_code_allowed` before its module runs.

    Args:
        spec: ``"pkg.module:attr"`` or ``"pkg.module.attr"`` (see :func:`split_dotted`).
        what: How messages name the thing, e.g. ``"reward function"`` or ``"rollout.multi_turn.tools: tool"``.
        example: The spelling the fixes suggest, e.g. ``"package.module:function"``.
        builtins: Built-in names listed when ``spec`` is not a dotted path (None lists none).

    Raises:
        ValueError: one line naming ``spec`` and the fix when it is not dotted, its module is not allowed
            (:class:`CodeNotAllowedError`) or cannot be imported, or the attribute is missing.
    """
    module_name, attr_path = split_dotted(spec)
    if not module_name or not attr_path:
        listed = f" ({builtins})" if builtins is not None else ""
        raise ValueError(
            f"{what} {spec!r} is neither a built-in{listed} nor a dotted path; use a built-in name or {example!r}."
        )
    check_code_allowed(module_name, what=f"{what} {spec!r}")  # importing runs the module: the operator's list
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({err}); install the package or put it on "
            f"PYTHONPATH of every worker, or fix the spelling ({example!r})."
        ) from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr_path!r}; fix the name after the "
                f"module ({example!r})."
            )
        obj = getattr(obj, part)
    return obj
