"""Domain reserve: keep enough room, of the right shapes, to re-place what any one failure domain holds.

The failover reserve sized per failure domain (``kind``: ``rack`` by default; ``power_feed``, ``zone`` or ``node``
as well). A :class:`~octacloud.scheduler.actions.backup.BackupPlan` keeps a backup outside its domain for every
allocation; this rule lets normal work take only what is free beyond the backups' reservation, and only on nodes
whose domain could back the new work up too, so that every domain stays re-placeable. Backups chosen one at a
time, as work arrives, come to reserve more than backups chosen at once for the work as it now is; before the rule
refuses a request it chooses them again at once (:meth:`BackupPlan.replan`), when ``replan_after`` were chosen
one by one since the last time. Failover work
(``Request.failover``) and priority at least ``high_priority`` may use the reservation: it is what it is for.
A fleet of one domain has nothing to keep (the rule steps aside).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from octacloud.core.domains import DOMAIN_KINDS
from octacloud.scheduler.actions.backup import BackupPlan
from octacloud.scheduler.framework.api import SUCCESS, Code, CycleContext, Status
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.plugins.headroom import DEFAULT_HIGH_PRIORITY
from octacloud.scheduler.registry import Args, PluginContext

DEFAULT_REPLAN_AFTER = 64


@dataclass(slots=True)
class DomainReserve:
    kind: str = "rack"
    high_priority: int = DEFAULT_HIGH_PRIORITY
    replan_after: int = DEFAULT_REPLAN_AFTER
    """When the rule would refuse a request, the plan is first made again at once if at least this many backups
    were chosen one by one since it last was."""
    name: str = "domain-reserve"
    _plan: BackupPlan | None = field(default=None, init=False, repr=False)

    def plan(self, state: ClusterState) -> BackupPlan:
        """The backup plan of ``state`` (made on first use; one state per scheduler)."""
        if self._plan is None or self._plan.state is not state:
            self._plan = BackupPlan(state, self.kind)
        return self._plan

    def pre_filter(self, ctx: CycleContext) -> Status:
        r = ctx.request
        plan = self.plan(ctx.state)
        if r.failover or r.priority >= self.high_priority or plan.domains < 2:
            return Status(Code.SKIP)
        plan.sync()
        return SUCCESS

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        plan = self.plan(ctx.state)
        kept = self._keep(plan, ctx, nodes)
        if not kept and nodes and plan.changes >= self.replan_after:
            plan.replan()  # backups chosen one by one reserve more than ones chosen at once: choose again
            kept = self._keep(plan, ctx, nodes)
        return kept

    def _keep(self, plan: BackupPlan, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        r, names = ctx.request, plan.domain
        backed: dict[str, bool] = {}
        kept: list[int] = []
        for i in nodes:
            if not plan.admits(r, i):
                continue
            d = names[i]
            ok = backed.get(d)
            if ok is None:
                ok = backed[d] = plan.has_backup(r, d, nodes)
            if ok:
                kept.append(i)
        return kept


def build(name: str, args: Args, ctx: PluginContext) -> DomainReserve:
    return DomainReserve(
        args.text("kind", "rack", choices=DOMAIN_KINDS),
        args.integer("high_priority", DEFAULT_HIGH_PRIORITY),
        args.integer("replan_after", DEFAULT_REPLAN_AFTER, low=1),
        name,
    )
