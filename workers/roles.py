"""The worker-role table: which Ray worker groups a run starts, from which class, on which pool, called how.

A role is one entry of :data:`WORKER_ROLES`: its ``target`` builds ``(worker class, spec)`` from the run's config
and plan (None: the run does not need the role), ``client`` wraps the started group in the controller's typed
interface (``rlhf_ops.trainer.roles``), ``pool`` says where its processes go and ``methods`` names the worker's
registered dispatch methods the client calls (``@register``), checked when the group starts. The launcher
(:mod:`workers.launcher`) starts every needed role in table order and hands the controller one client per role,
so a new role is its worker module (spec, worker, builder) and its entry, plus the controller stage that calls it.

A user's role is registered from its own package (``WORKER_ROLES.register(WorkerRole(...))`` in a module the run
imports, or an entry point in the ``rlhf_ops.worker_roles`` group, loaded when the groups start).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

from rlhf_ops.extensions.table import Entry, Table, load_target
from workers.single_controller.decorator import registered_methods

if TYPE_CHECKING:
    from rlhf_ops.config.batch_plan import BatchPlan
    from rlhf_ops.config.schema import RunConfig


@dataclass(frozen=True, kw_only=True)
class RoleContext:
    """What every role builder gets besides the config and the plan (the driver resolved them once)."""

    model_path: str
    pad_token_id: int
    eos_token_id: int | tuple[int, ...]
    profile_steps: tuple[int, ...]
    profile_dir: str


@dataclass(frozen=True, kw_only=True)
class WorkerRole(Entry):
    """A worker role; ``target`` is ``build(config, plan, ctx) -> (worker class, spec) | None``.

    Attributes:
        client: The driver-side client class, called with the started group (``"module:Class"``); None: the group.
        pool: Where its processes go: ``"colocated"`` (every role on every bundle of the run's one pool, each a
            fraction of the bundle's CPUs / GPU).
        methods: The worker's registered dispatch methods its client calls (checked at start).
        watched: The client bounds each call by ``trainer.rollout_watchdog_s`` (it takes ``watchdog_s``).
    """

    client: str | Any | None = None
    pool: Literal["colocated"] = "colocated"
    methods: tuple[str, ...] = ()
    watched: bool = False

    def build(self, config: RunConfig, plan: BatchPlan, ctx: RoleContext) -> tuple[type, Any] | None:
        """``(worker class, spec)`` for this run, or None when the run does not need the role.

        Raises:
            ValueError: the worker class does not register a method of :attr:`methods`.
        """
        built: tuple[type, Any] | None = self.load()(config, plan, ctx)
        if built is not None:
            missing = [m for m in self.methods if m not in registered_methods(built[0])]
            if missing:
                raise ValueError(
                    f"worker role {self.name!r}: {built[0].__name__} registers no dispatch method {missing}; "
                    "decorate them with @register(...)"
                )
        return built

    def wrap(self, group: Any, config: RunConfig) -> Any:
        """The client of a started group (the group itself without a client class)."""
        if self.client is None:
            return group
        settings = {"watchdog_s": config.trainer.rollout_watchdog_s} if self.watched else {}
        return load_target(self.client)(group, **settings)


_ROLES = "workers.role_specs"
WORKER_ROLES: Table[WorkerRole] = Table(
    what="worker role",
    key="worker role",
    entry_type=WorkerRole,
    group="rlhf_ops.worker_roles",
    from_callable=None,
    entries=[
        WorkerRole(
            name="actor_rollout_ref",
            target=f"{_ROLES}:actor_rollout_ref",
            client="workers.clients:ActorRolloutRefClient",
            methods=("init_model", "generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint"),
            watched=True,
            description="The policy: FSDP2 actor, rollout engine and (when the run needs it) the reference.",
        ),
        WorkerRole(
            name="critic",
            target=f"{_ROLES}:critic",
            client="workers.clients:CriticClient",
            methods=("init_model", "compute_values", "update_critic", "save_checkpoint"),
            description="The value model (estimators that need a critic).",
        ),
        WorkerRole(
            name="reward_model",
            target=f"{_ROLES}:reward_model",
            client="workers.clients:RewardModelClient",
            methods=("init_model", "compute_rm_score"),
            description="A sequence-classification reward model (reward.model_path).",
        ),
    ],
)


def active_roles() -> list[WorkerRole]:
    """Every role: the table's, then those of installed packages' entry points, in that order."""
    roles = list(WORKER_ROLES)
    known = {role.name for role in roles}
    for ep in entry_points(group=WORKER_ROLES.group):
        if ep.name not in known:
            roles.append(WORKER_ROLES.get(ep.name))
    return roles
