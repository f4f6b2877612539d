"""Airflow plugin registering the RLHF operator extra links (Ray job, MLflow run, checkpoint folder).

Registered links are what the Airflow 3 API server calls to render the buttons of ``RayJobOperator`` tasks;
they read XComs from the metadata DB there (see ``rlhf_airflow.links``). The installed provider registers this
plugin through its provider info (``plugins``); a source checkout without the installed provider registers it
through ``plugins/rlhf_plugin.py`` in the plugins folder. Imports stay light: no torch.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from rlhf_airflow.links import CheckpointFolderLink, MlflowRunLink, RayJobLink
from rlhf_airflow.operators import RayJobOperator
from rlhf_airflow.task_jobs import RayTaskJobOperator

# ``BaseOperatorLink.operators`` names the operator classes a plugin link decorates (matched by class name and
# module). Set here, at the registration point, because links.py cannot import operators.py (cycle).
for _link_cls in (RayJobLink, MlflowRunLink, CheckpointFolderLink):
    _link_cls.operators = [RayJobOperator, RayTaskJobOperator]


class RlhfPlugin(AirflowPlugin):
    """Extra links for ``RayJobOperator`` and its heavy-task subclass ``RayTaskJobOperator``."""

    name = "rlhf"
    operator_extra_links = [RayJobLink(), MlflowRunLink(), CheckpointFolderLink()]
