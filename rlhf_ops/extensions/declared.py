"""Built-in entries declared next to their code: a decorator on the function, read from the source.

A built-in advantage estimator, policy loss, KL estimator or reward function is one function with a
decorator that states its name and traits::

    @advantage_estimator("grpo", group=True, config_params=("norm_adv_by_std_in_grpo",))
    @torch.no_grad()
    def compute_grpo_outcome_advantage(...): ...

The table must know its names without importing the function's module (that module imports torch; the
config, the pre-flight and the Airflow side must not), so the table reads the decorators from the module's
source with :mod:`ast`: the decorator's arguments are literals, and the source is parsed, never executed.
When the module is imported, the same decorator checks that the entry it builds is the one the table read
(:func:`declare`), so the two cannot drift; code outside the scanned modules (a plug-in, a test) registers
its entry with the same decorator when its module is imported.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rlhf_ops.extensions.table import Entry, Table

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Declaration:
    """One decorated function as the source states it.

    Attributes:
        module: The dotted module name (``rlhf_ops.algorithms.advantages``).
        function: The function's name in that module.
        args: The decorator's positional arguments (the entry's name or names).
        kwargs: The decorator's keyword arguments (the traits).
        doc: The first line of the function's docstring (the description when none is given).
    """

    module: str
    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    doc: str = ""

    @property
    def target(self) -> str:
        """``"module:function"``, what the entry's ``target`` names."""
        return f"{self.module}:{self.function}"


def _package_dir(package: str) -> Path:
    """The folder of ``package`` without importing it (only its top-level package is imported, if at all)."""
    top, *rest = package.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"built-in entries: package {top!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)


def module_files(pattern: str) -> list[tuple[str, Path]]:
    """``(module name, source file)`` of ``pattern``: one module (``pkg.mod``) or every module of a package
    (``pkg.sub.*``, sorted by name, ``__init__`` excluded)."""
    if pattern.endswith(".*"):
        package = pattern[:-2]
        folder = _package_dir(package)
        return [(f"{package}.{path.stem}", path) for path in sorted(folder.glob("*.py")) if path.stem != "__init__"]
    package, _, name = pattern.rpartition(".")
    return [(pattern, _package_dir(package) / f"{name}.py")]


def _decorator_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as err:
        raise ValueError(
            f"{where}: the decorator's arguments must be literals (the table reads them from the source)"
        ) from err


def declarations(pattern: str, decorator: str) -> Iterator[Declaration]:
    """The functions of ``pattern``'s modules decorated with ``@decorator(...)``, in source order."""
    for module, path in module_files(pattern):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if _decorator_name(deco) != decorator or not isinstance(deco, ast.Call):
                    continue
                where = f"{path.name}:{deco.lineno} @{decorator}"
                kwargs = {kw.arg: _literal(kw.value, where) for kw in deco.keywords if kw.arg is not None}
                doc = (ast.get_docstring(node) or "").split("\n")[0]
                args = tuple(_literal(arg, where) for arg in deco.args)
                yield Declaration(module=module, function=node.name, args=args, kwargs=kwargs, doc=doc)


E = TypeVar("E", bound="Entry")


def declare(table: Table[E], build: Callable[[Declaration], list[E]], *args: Any, **kwargs: Any) -> Callable[[F], F]:
    """The decorator's runtime side: builds the entries of the decorated function as the table's scan does.

    A function of a scanned module finds its entries in the table already (a different one under the same
    name is an error: two functions declared one name); any other function (a plug-in, a test) registers
    them, so ``@advantage_estimator("mine")`` in a module the run imports is enough.
    """

    def mark(fn: F) -> F:
        doc = (getattr(fn, "__doc__", None) or "").strip().split("\n")[0]
        found = Declaration(module=fn.__module__, function=fn.__name__, args=args, kwargs=dict(kwargs), doc=doc)
        for entry in build(found):
            known = table.known(entry.name)
            if known is None:
                table.register(entry)
            elif known != entry:
                raise ValueError(
                    f"{table.what} {entry.name!r} is declared as {entry} and as {known}; "
                    "give one of them another name, or make the decorator's arguments literals"
                )
        return fn

    return mark
