"""The fleet's nodes, and the slices that replicas hold on them in the scheduler's state.

Every replica that is placed holds its slice in the scheduler's :class:`ClusterState`, accounted by the request
:meth:`Reservations.request` makes for it; a slice is released only once nothing runs on it any longer (a stop
releases after the process has exited). A replica that must not be moved by defragmentation is *pinned*: a
surge replica, one being stopped, and a replacement until the replica it replaces is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses

from octacloud.control.controller.contracts import FootprintSource, Wakeup
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.store import Store
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import Allocation, ClusterState


class Reservations:
    def __init__(
        self, nodes: list[Node], scheduler: Scheduler, footprint: FootprintSource, store: Store, wakeup: Wakeup
    ) -> None:
        self.nodes = nodes
        self.scheduler = scheduler
        """Replaced when a node joins the fleet (:meth:`grow`)."""
        self._footprint = footprint
        self._store = store
        self._wakeup = wakeup

    def request(self, r: Replica, d: Deployment) -> Request:
        """The scheduler's request for replica ``r`` of ``d``, sized by what ``r`` runs."""
        model, _version, octants = r.runs(d)
        whole = octants >= OCTANTS_PER_GPU
        return Request(
            name=r.id,
            num_gpu=octants // OCTANTS_PER_GPU if whole else 1,
            gpu_milli=MILLI_PER_GPU if whole else octants * MILLI_PER_OCTANT,
            gpu_memory_mib=self.memory_mib(model),
            priority=d.spec.priority,
            owner=d.spec.tenant,
            pinned=bool(r.replaces) or r.state is ReplicaState.STOPPING or self._store.transition(r.id) is not None,
            failover=r.failover,
            model=model,
            group=d.spec.name,
            spread=d.spec.spread,
        )

    def memory_mib(self, model: str) -> int:
        """The card memory ``model`` needs (0 when its footprint is unknown)."""
        try:
            return self._footprint(model).memory_mib
        except (NotFoundError, InvalidSpecError):
            return 0

    def reserve(self, r: Replica, d: Deployment) -> None:
        """Account ``r``'s own slice to it; raises InvalidSpecError when the slice is not free."""
        self.scheduler.commit(self.request(r, d), r.placement())

    def commit(self, request: Request, placement: Placement) -> None:
        self.scheduler.commit(request, placement)

    def release(self, replica_id: str) -> None:
        """Give back the slice ``replica_id`` holds, if it holds one."""
        if self.holds(replica_id):
            self.scheduler.release(replica_id)
            self._wakeup.slice_freed()

    def holds(self, replica_id: str) -> bool:
        return self.allocation(replica_id) is not None

    def allocation(self, replica_id: str) -> Allocation | None:
        """What ``replica_id`` holds in the scheduler's state (None: nothing)."""
        return self.scheduler.state.allocations.get(replica_id)

    def pin(self, replica_id: str, pinned: bool = True) -> None:
        """Re-account ``replica_id``'s slice as (un)movable by defragmentation (same slice, same size)."""
        a = self.allocation(replica_id)
        if a is None or a.request.pinned is pinned:
            return
        self.scheduler.release(replica_id)
        with contextlib.suppress(InvalidSpecError):
            self.scheduler.commit(dataclasses.replace(a.request, pinned=pinned), a.placement)

    def node(self, name: str) -> Node:
        return self.nodes[self.scheduler.state.node_index(name)]

    def usable(self, r: Replica) -> bool:
        """Whether ``r`` holds its slice and every card of it takes work."""
        state = self.scheduler.state
        i = state.node_index(r.node)
        return self.holds(r.id) and all(state.card_usable(i, g) for g in r.gpus)

    def grow(self, *nodes: Node) -> Scheduler:
        """Rebuild the scheduler's state with ``nodes`` added, carrying over every allocation and health; returns
        the new scheduler."""
        old = self.scheduler.state
        fresh = ClusterState([*(_all_healthy(n) for n in old.nodes), *(_all_healthy(n) for n in nodes)])
        scheduler = Scheduler(fresh, self.scheduler.profile)
        for a in old:
            scheduler.commit(a.request, a.placement)
        for n in [*old.nodes, *nodes]:
            for g in n.gpus:
                if g.health is not Health.HEALTHY:
                    fresh.set_card_health(n.name, g.index, g.health)
            if n.health is not Health.HEALTHY:
                fresh.set_node_health(n.name, n.health)
        self.scheduler = scheduler
        self.nodes.extend(nodes)
        return scheduler


def _all_healthy(node: Node) -> Node:
    gpus = tuple(dataclasses.replace(g, health=Health.HEALTHY) for g in node.gpus)
    return dataclasses.replace(node, gpus=gpus, health=Health.HEALTHY)
