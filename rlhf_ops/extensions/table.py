"""The one shape of every extension point: a table of named entries that carry their traits.

An extension point (advantage estimators, policy losses, KL estimators, reward functions, rollout engines)
is one :class:`Table`. Its entries say what the rest of the code asks of them (group-based? needs a critic?
which engine modes?), so the config's allowed values, the cross-field validation and the dispatch all read
the table instead of repeating its names.

Three ways an entry gets in:

- built in: a decorator on the function, in the module that defines it (``@advantage_estimator("grpo",
  group=True)``), read from the module's source (:mod:`rlhf_ops.extensions.declared`), so the table stays
  torch-free: an entry names its code by a ``"module:attribute"`` string, imported only when it is used;
- an installed package's entry point in the table's group (``[project.entry-points."rlhf_ops.advantage_estimators"]
  my_adv = "my_pkg.adv:ESTIMATOR"``): found by name, listed by ``rlhf config schema``;
- a dotted path in the config value itself (``algorithm.adv_estimator=my_pkg.adv:my_estimator``), imported
  through the operator's allow-list (:mod:`rlhf_ops.code_policy`).

An entry point or dotted path names either an entry object of the table's class (traits stated) or a plain
callable (the table's ``from_callable`` reads the traits from the callable, e.g. its parameter names).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlhf_ops.code_policy import import_dotted, split_dotted
from rlhf_ops.extensions.declared import Declaration, declarations

if TYPE_CHECKING:  # pydantic only where a config field is built: the algorithms import the tables on the GPU check's
    # machine, which has no pydantic (scripts/gpu_check_lite.py)
    from pydantic import AfterValidator
    from pydantic.fields import FieldInfo


@dataclass(frozen=True, kw_only=True)
class Entry:
    """What every entry has: its config name, its code and a line for the schema and the docs.

    Attributes:
        name: The config value that selects it.
        target: The code: ``"module:attribute"`` (imported on first use) or the object itself.
        description: One line for ``rlhf config schema`` and the docs.
    """

    name: str
    target: str | Any
    description: str = ""

    def load(self) -> Any:
        """The entry's code (a built-in's module is imported here, never when the table is read)."""
        return load_target(self.target)


def load_target(target: str | Any) -> Any:
    """The object ``"module:attribute"`` names (imported now), or ``target`` itself when it is no string."""
    if not isinstance(target, str):
        return target
    module, attr = split_dotted(target)
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


E = TypeVar("E", bound=Entry)


def is_dotted(value: str) -> bool:
    """Whether a config value names user code (``pkg.mod:attr``) rather than a registered name."""
    return ":" in value


class Table(Generic[E]):
    """The entries of one extension point, by name.

    Args:
        what: How messages name an entry (``"advantage estimator"``).
        key: The config key that selects one (``"algorithm.adv_estimator"``).
        entry_type: The entry class (a dotted path or entry point may name an instance of it).
        group: The entry-point group installed packages register under (``"rlhf_ops.advantage_estimators"``).
        from_callable: Builds an entry from a plain callable (``name``, callable); None: only entry objects.
        entries: Built-in entries stated here (the rollout engines).
        declared_in: Modules whose decorated functions are built-in entries (``"pkg.mod"``, or ``"pkg.sub.*"``
            for every module of a package), read from their source (:mod:`rlhf_ops.extensions.declared`).
        decorator: The decorator's name in those modules.
        build: The entries one declaration stands for (a KL estimator's names and their ``+`` forms).
        imported_in: Packages whose modules are imported when the table is first read, their decorators
            registering the built-in entries (``"pkg.sub"``): for torch-free modules only (the pipeline jobs,
            whose entries are pydantic models the Airflow side needs anyway).
    """

    def __init__(
        self,
        *,
        what: str,
        key: str,
        entry_type: type[E],
        group: str,
        from_callable: Callable[[str, Any], E] | None,
        entries: list[E] | None = None,
        declared_in: tuple[str, ...] = (),
        decorator: str = "",
        build: Callable[[Declaration], list[E]] | None = None,
        imported_in: tuple[str, ...] = (),
    ) -> None:
        self.what, self.key, self.entry_type, self.group = what, key, entry_type, group
        self._from_callable = from_callable
        self._builtins: dict[str, E] = {}
        self._to_import = imported_in
        for entry in entries or []:
            self.register(entry)
        for pattern in declared_in:
            assert build is not None and decorator, "a table with declared_in needs decorator and build"
            for declaration in declarations(pattern, decorator):
                for entry in build(declaration):
                    self.register(entry)

    @property
    def _entries(self) -> dict[str, E]:
        """The built-in and registered entries, after importing the ``imported_in`` packages' modules once."""
        if self._to_import:
            packages, self._to_import = self._to_import, ()  # first: their decorators read the table again
            for package in packages:
                found = importlib.import_module(package)
                for info in pkgutil.iter_modules(found.__path__, prefix=f"{package}."):
                    importlib.import_module(info.name)
        return self._builtins

    def register(self, entry: E) -> E:
        """Adds ``entry`` (a package's own entries; tests). A name taken by another entry is an error."""
        if entry.name in self._builtins and self._builtins[entry.name] != entry:
            raise ValueError(f"{self.what} {entry.name!r} is registered twice; give one of them another name")
        self._builtins[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Removes a registered entry (tests that register a throw-away one)."""
        self._builtins.pop(name, None)

    def builtin_names(self) -> list[str]:
        """The names known without importing anything (built-in and registered entries)."""
        return list(self._entries)

    def names(self) -> list[str]:
        """Every selectable name: built-in and registered, then installed entry points (not loaded)."""
        installed = [ep.name for ep in entry_points(group=self.group) if ep.name not in self._entries]
        return [*self._entries, *sorted(installed)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self.names())

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries.values()))

    def find(self, value: str) -> E | None:
        """The entry of ``value``, or None when it does not resolve here (the pre-flight reports why)."""
        try:
            return self.get(value)
        except (ValueError, ImportError):
            return None

    def known(self, value: str) -> E | None:
        """The entry of ``value`` when it is known without importing user code (built-in or registered)."""
        return self._entries.get(value)

    def get(self, value: str, *, key: str | None = None) -> E:
        """The entry a config value selects: a name (built-in, registered, entry point) or a dotted path.

        ``key`` names the config key in messages when it is not the table's own (``algorithm.kl_loss_type``).

        Raises:
            ValueError: one line naming ``key``, the value and the fix (unknown name, import error, not allowed
                by the operator's list, an object that is neither an entry nor a callable).
        """
        key = key or self.key
        if value in self._entries:
            return self._entries[value]
        if is_dotted(value):
            obj = import_dotted(value, what=f"{key}: {self.what}", example="package.module:attribute")
            return self._entry_of(value, obj, key)
        found = list(entry_points(group=self.group, name=value))
        if found:
            try:
                obj = found[0].load()
            except Exception as err:  # an installed plug-in's import failure is the plug-in's, one line
                raise ValueError(
                    f"{key}={value!r}: the entry point {found[0].value!r} in group {self.group} does not "
                    f"import ({type(err).__name__}: {err}); fix or reinstall the package that registers it"
                ) from err
            return self._entry_of(value, obj, key)
        raise ValueError(
            f"{key}={value!r} is not a registered {self.what}; set one of {self.names()} or a dotted path "
            "'package.module:attribute'"
        )

    def _entry_of(self, value: str, obj: Any, key: str) -> E:
        if isinstance(obj, self.entry_type):
            return obj
        if self._from_callable is not None and callable(obj):
            return self._from_callable(value, obj)
        kind = f"a {self.entry_type.__name__}" + (" or a function" if self._from_callable else "")
        raise ValueError(f"{key}={value!r} names a {type(obj).__name__}, not {kind}; point it at {kind}")

    def schema_extra(self) -> Callable[[dict[str, Any]], None]:
        """A pydantic ``json_schema_extra`` that lists the names selectable now (entry points included)."""

        def extra(schema: dict[str, Any]) -> None:
            schema["examples"] = self.names()
            schema["x-extension-point"] = {"group": self.group, "dotted_path": "package.module:attribute"}

        return extra


def choice_check(table: Table[Any]) -> AfterValidator:
    """The validator of a config field that selects an entry of ``table``: a selectable name or a dotted path.

    A dotted path is imported at pre-flight, not here: the Airflow side may validate a config whose user code
    only the Ray job has.
    """
    from pydantic import AfterValidator
    from pydantic_core import PydanticCustomError

    def check(value: str) -> str:
        if is_dotted(value) or value in table:
            return value
        raise PydanticCustomError(
            "unknown_entry",
            "is not a registered {what}",
            {"what": table.what, "fix": f"set one of {table.names()} or a dotted path 'package.module:attribute'"},
        )

    return AfterValidator(check)


def choice_schema(table: Table[Any]) -> FieldInfo:
    """The schema of such a field: it lists the names selectable now (``rlhf config schema``)."""
    from pydantic import Field

    info: FieldInfo = Field(json_schema_extra=table.schema_extra())
    return info
