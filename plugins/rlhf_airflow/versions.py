"""The versions the provider works with, checked where a mismatch would otherwise surface as a confusing error.

* Airflow: a range of Airflow 3 releases (``SUPPORTED_AIRFLOW``), checked when the package is imported.
* The library: ``rlhf-ops`` must be the provider's own release (both are built from one repository and move
  together), checked when the package is imported.
* Ray: the cluster behind a ``ray`` connection must run a release in ``SUPPORTED_RAY``, checked by the
  connection's Test button and before a job is submitted.

Each problem is one line naming what and the fix. Imports stay light (no Airflow, no Ray): this module runs when
the package is imported, before anything else of it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

PROVIDER_DISTRIBUTION = "airflow-provider-rlhf"
LIBRARY_DISTRIBUTION = "rlhf-ops"
# Keep in step with plugins/pyproject.toml's dependencies (tests/unit/packaging checks both).
SUPPORTED_AIRFLOW = SpecifierSet(">=3.1,<4")
SUPPORTED_RAY = SpecifierSet(">=2.60,<3")


class VersionMismatch(RuntimeError):
    """The provider sits next to an Airflow, library or Ray release it does not support (one-line message)."""


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed (e.g. a source checkout)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _release(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def airflow_problem(airflow_version: str | None) -> str | None:
    """Why ``airflow_version`` is not supported, or None when it is (or unknown)."""
    parsed = _release(airflow_version) if airflow_version else None
    if parsed is None or SUPPORTED_AIRFLOW.contains(parsed, prereleases=True):
        return None
    return (
        f"{PROVIDER_DISTRIBUTION} supports apache-airflow{SUPPORTED_AIRFLOW}, but apache-airflow {airflow_version} "
        f"is installed; install it into an Airflow 3 environment (pip install 'apache-airflow{SUPPORTED_AIRFLOW}')"
    )


def library_problem(provider_version: str | None, library_version: str | None) -> str | None:
    """Why the installed library does not fit the provider, or None when it does (or either is not installed)."""
    if provider_version is None:  # a source checkout (plugins/ on sys.path): nothing to compare
        return None
    if library_version is None:
        return (
            f"{PROVIDER_DISTRIBUTION} {provider_version} needs {LIBRARY_DISTRIBUTION} {provider_version}, which is "
            f"not installed; fix: pip install '{LIBRARY_DISTRIBUTION}=={provider_version}'"
        )
    if _release(library_version) != _release(provider_version):
        return (
            f"{PROVIDER_DISTRIBUTION} {provider_version} needs {LIBRARY_DISTRIBUTION} {provider_version}, but "
            f"{LIBRARY_DISTRIBUTION} {library_version} is installed; fix: pip install "
            f"'{LIBRARY_DISTRIBUTION}=={provider_version}' (or the provider release matching {library_version})"
        )
    return None


def ray_problem(ray_version: str | None, *, where: str) -> str | None:
    """Why the Ray release of the cluster at ``where`` is not supported, or None when it is."""
    parsed = _release(ray_version) if ray_version else None
    if parsed is None:
        return f"the Ray job server at {where} did not report its Ray version; is it a Ray dashboard (port 8265)?"
    if SUPPORTED_RAY.contains(parsed, prereleases=True):
        return None
    return (
        f"the Ray cluster at {where} runs Ray {ray_version}, but {PROVIDER_DISTRIBUTION} supports ray{SUPPORTED_RAY}; "
        f"upgrade the cluster (or point the connection at one running ray{SUPPORTED_RAY})"
    )


def check_installation() -> None:
    """Refuse an unsupported Airflow or a library of another release than the provider's.

    Raises:
        VersionMismatch: one line naming both versions and the fix.
    """
    for problem in (
        airflow_problem(installed("apache-airflow-core") or installed("apache-airflow")),
        library_problem(installed(PROVIDER_DISTRIBUTION), installed(LIBRARY_DISTRIBUTION)),
    ):
        if problem:
            raise VersionMismatch(problem)
