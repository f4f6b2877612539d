"""The trigger form: one JSON-Schema ``Param`` per pipeline parameter (rendered by the Airflow UI).

Generated from the library's schema (:class:`rlhf_ops.pipeline.params.PipelineParams`, torch-free): names,
types, defaults, descriptions, constraints and sections have one source, so the form and the library refuse
the same values. A value that breaks the schema is refused by the form and by the REST API before a run
exists; values the schema cannot judge (a config override, a combination of settings) fail at ``preflight``
with the config's message. ``tests/unit/dags/test_params_form.py`` pins the form users see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import Param

from rlhf_ops.pipeline.params import form_param_specs

# name: (default, form section, description, JSON-Schema keywords)
PARAM_SPECS: dict[str, tuple[Any, str, str, dict[str, Any]]] = form_param_specs()


def pipeline_params(defaults: Mapping[str, Any] | None = None) -> dict[str, Param]:
    """The pipeline's ``Param``s; ``defaults`` (from a YAML spec) replace the default values.

    Raises:
        ValueError: ``defaults`` names an unknown parameter.
    """
    d = dict(defaults or {})
    unknown = sorted(set(d) - set(PARAM_SPECS))
    if unknown:
        raise ValueError(f"unknown pipeline parameter(s) {unknown}; known: {sorted(PARAM_SPECS)}")
    return {
        name: Param(d.get(name, default), description=description, section=section, **extra)
        for name, (default, section, description, extra) in PARAM_SPECS.items()
    }
