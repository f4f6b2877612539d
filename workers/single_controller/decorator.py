"""The ``@register`` contract between a worker class and the driver's worker group.

A worker method becomes callable from the driver only when it is decorated with
``@register(dispatch_mode=...)``. The decorator records a :class:`DispatchSpec` on the function
object and returns the same function: nothing is bound, wrapped or generated at runtime. The
worker group reads the spec when it dispatches a call (see ``worker_group.RayWorkerGroup.call``).

Dispatch modes:

- ``ONE_TO_ALL``: the same arguments go to every rank; the result is the list of every rank's
  return value, ordered by rank.
- ``DP_COMPUTE_PROTO``: every ``DataProto`` argument is padded to a multiple of the data-parallel
  size and split into one chunk per data-parallel rank (ranks of one sequence-parallel group share a
  chunk); other arguments are sent unchanged. Each data-parallel group's result (a ``DataProto``)
  is gathered back in order and the padding removed.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "DISPATCH_ATTR",
    "Dispatch",
    "DispatchSpec",
    "get_dispatch_spec",
    "register",
    "registered_methods",
    "resolve_method",
]

DISPATCH_ATTR = "__rlhf_dispatch__"
"""Name of the function attribute that holds the :class:`DispatchSpec`."""

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    """How a registered worker method is dispatched to the ranks of a worker group."""

    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"


@dataclass(frozen=True, kw_only=True)
class DispatchSpec:
    """What ``@register`` records on a worker method."""

    mode: Dispatch
    """How the driver splits the arguments and collects the results."""
    blocking: bool = True
    """``True``: ``RayWorkerGroup.call`` waits for the result. ``False``: it returns a ``GroupFuture``."""


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, *, blocking: bool = True) -> Callable[[F], F]:
    """Mark a worker method as callable from the driver with the given dispatch mode.

    Args:
        dispatch_mode: How arguments are sent to the ranks and results collected.
        blocking: Whether ``RayWorkerGroup.call`` waits for the result (``True``) or returns a
            ``GroupFuture`` to wait on later (``False``).

    Returns:
        A decorator that stores a :class:`DispatchSpec` under ``__rlhf_dispatch__`` on the function
        and returns the function itself, unchanged.

    Raises:
        TypeError: If ``dispatch_mode`` is not a :class:`Dispatch` (e.g. ``@register`` used without
            parentheses) or the decorated object is not a plain function.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(
            f"register(dispatch_mode=...) expects a Dispatch member, got {dispatch_mode!r}; "
            "write @register(dispatch_mode=Dispatch.ONE_TO_ALL) (with parentheses)."
        )
    spec = DispatchSpec(mode=dispatch_mode, blocking=blocking)

    def decorate(fn: F) -> F:
        if not inspect.isfunction(fn):
            raise TypeError(f"@register decorates plain methods (def ...), got {fn!r}.")
        setattr(fn, DISPATCH_ATTR, spec)
        return fn

    return decorate


def get_dispatch_spec(fn: object) -> DispatchSpec | None:
    """Return the :class:`DispatchSpec` recorded by ``@register`` on ``fn``, or ``None``."""
    spec = getattr(fn, DISPATCH_ATTR, None)
    return spec if isinstance(spec, DispatchSpec) else None


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included), by name, sorted."""
    found: dict[str, DispatchSpec] = {}
    for name in dir(cls):
        spec = get_dispatch_spec(inspect.getattr_static(cls, name, None))
        if spec is not None:
            found[name] = spec
    return dict(sorted(found.items()))


def resolve_method(
    worker_cls: type,
    method: Callable[..., Any] | str,
    *,
    role: str,
    registered: dict[str, DispatchSpec] | None = None,
) -> tuple[str, DispatchSpec]:
    """Find the registered method a driver call refers to, by reference or by name.

    Args:
        worker_cls: The worker group's worker class.
        method: ``WorkerCls.method`` (checked by mypy at the call site) or the method's name.
        role: The group's name, for the error message.
        registered: ``registered_methods(worker_cls)``, if already computed.

    Returns:
        ``(name, spec)``.

    Raises:
        AttributeError: The method does not exist on ``worker_cls``, is not ``@register``-ed, or is a
            method of another class that merely has the same name.
    """
    registered = registered_methods(worker_cls) if registered is None else registered
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    spec = registered.get(name)
    if spec is None:
        what = "is not decorated with @register" if hasattr(worker_cls, name) else "does not exist"
        raise AttributeError(
            f"{worker_cls.__qualname__}.{name} {what}, so the [{role}] worker group cannot call it. "
            f"Registered methods: {sorted(registered)}. Decorate it with "
            "@register(dispatch_mode=Dispatch.ONE_TO_ALL) (or DP_COMPUTE_PROTO)."
        )
    # A same-named method of another worker class must not silently run here; an overridden base
    # method (Worker.dp_info on a subclass that overrides it) is the same call, so it is accepted.
    if not isinstance(method, str) and not any(vars(k).get(name) is method for k in worker_cls.__mro__):
        raise AttributeError(
            f"{method!r} is not {worker_cls.__qualname__}.{name} (nor a method it overrides); "
            f"pass a method of the [{role}] worker group's class."
        )
    return name, spec
