"""The optional approval gate before the ``champion`` alias moves (Airflow 3.1+ human-in-the-loop).

A spec's ``approval`` (off unless ``enabled``)::

    approval:
      enabled: true
      timeout_hours: 72          # no answer by then: rejected (the alias stays); null waits for ever
      assigned_users: [alice]    # who may answer (user ids of the auth manager); empty: anyone with access

With it on, ``register_model`` registers the version and decides (the paired test) without moving the alias,
and ``approve_champion`` (:class:`ChampionApproval`, an ``ApprovalOperator``) asks a person between it and
``promote_champion``. It asks only when the decision is to promote; a kept champion skips the question.
"Approve" lets ``promote_champion`` move the alias; "Reject" (or the timeout) skips it, and the run still ends
in success with the champion unchanged. Answer in the UI (Browse > Required Actions, or the task's Required
Actions tab) or with the REST API::

    PATCH /api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/approve_champion/-1/hitlDetails
    {"chosen_options": ["Approve"], "params_input": {}}

On Airflow 3.3 the waiting task is in the ``awaiting_input`` state: it holds no worker slot, no pool slot and
no triggerer; ``dag.test()`` waits for the answer too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

from rlhf_airflow.compat import AirflowSkipException

APPROVAL_KEYS = frozenset({"enabled", "timeout_hours", "assigned_users"})
TASK_ID = "approve_champion"
_REGISTERED = "{% set r = ti.xcom_pull(task_ids='register_model') %}"  # register_model's result, as ``r``
SUBJECT = _REGISTERED + "Move the champion of {{ r.registered_name }} to v{{ r.version }}?"
BODY = (
    _REGISTERED
    + """Run `{{ run_id }}` of `{{ dag.dag_id }}` registered **{{ r.registered_name }} v{{ r.version }}**
(step {{ r.best_step }}). The paired test says it should replace the current champion
({{ 'v' ~ r.champion_version if r.champion_version else 'none yet' }}):

{{ r.summary }}

Approve to move the `champion` alias; Reject to keep the current one.
"""
)


@dataclass(frozen=True, kw_only=True)
class ApprovalSpec:
    """Whether the gate is on, how long it waits, and who may answer."""

    enabled: bool = False
    timeout_hours: float | None = 72.0
    assigned_users: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"approval.enabled must be true or false, got {self.enabled!r}")
        hours = self.timeout_hours
        if hours is not None and (isinstance(hours, bool) or not isinstance(hours, int | float) or hours <= 0):
            raise ValueError(f"approval.timeout_hours must be a positive number of hours or null, got {hours!r}")
        if not all(isinstance(u, str) and u for u in self.assigned_users):
            raise ValueError(f"approval.assigned_users must be a list of user ids, got {list(self.assigned_users)!r}")


def approval_spec(spec: ApprovalSpec | Mapping[str, Any] | None) -> ApprovalSpec:
    """An :class:`ApprovalSpec` from a spec's ``approval`` mapping (None: off).

    Raises:
        ValueError: an unknown key or a bad value, named in the message.
    """
    if isinstance(spec, ApprovalSpec):
        return spec
    spec = dict(spec or {})
    unknown = sorted(set(spec) - APPROVAL_KEYS)
    if unknown:
        raise ValueError(f"unknown approval key(s) {unknown}; valid: {sorted(APPROVAL_KEYS)}")
    users = spec.pop("assigned_users", None) or []
    if not isinstance(users, list):
        raise ValueError(f"approval.assigned_users must be a list of user ids, got {users!r}")
    return ApprovalSpec(**spec, assigned_users=tuple(users))


class ChampionApproval(ApprovalOperator):
    """``ApprovalOperator`` that asks only when ``register_model`` decided to promote (else it skips)."""

    def execute(self, context: Any) -> Any:
        registered = context["ti"].xcom_pull(task_ids="register_model") or {}
        if not registered.get("promote"):
            raise AirflowSkipException(f"nothing to approve, the champion stays: {registered.get('summary')}")
        return super().execute(context)


def approval_task(spec: ApprovalSpec) -> ChampionApproval:
    """The gate task (call inside the DAG's context)."""
    timeout = timedelta(hours=spec.timeout_hours) if spec.timeout_hours else None
    users = [{"id": user, "name": user} for user in spec.assigned_users] or None
    return ChampionApproval(
        task_id=TASK_ID,
        subject=SUBJECT,
        body=BODY,
        defaults="Reject",  # what a timeout answers: the alias never moves without a person's yes
        response_timeout=timeout,
        assigned_users=users,  # HITLUser: a TypedDict of id and name
    )
