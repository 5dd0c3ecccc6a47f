"""Evacuation: could everything on a failure domain be re-placed elsewhere now?

:func:`evacuate` answers for one set of nodes (a rack, a power feed, a zone, a node) by trying it: in one
:class:`~octacloud.scheduler.framework.transaction.Transaction` it releases every allocation on those nodes and
re-places each one, as failover work (``Request.failover``: it may use the failover reserve), on the other nodes
with the scheduler's own profile — highest priority first, then the most GPU, as the re-evaluation loop would
re-place what a failure left pending. Unless ``commit`` is set the transaction is rolled back, so the state is
exactly as before. :func:`domain_coverage` does it for every domain of a kind that holds work.

The answer is the cloud's per-domain failover reserve: a domain is *covered* when everything on it could be
re-placed now. The controller exports it (``octacloud_failure_domain_covered``), the simulator measures it after
a rack loss, and the ``domain-reserve`` plugin keeps it true where it can.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from octacloud.core.domains import group_by_domain
from octacloud.core.model import Placement, Request
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import Allocation


@dataclass(slots=True)
class Evacuation:
    """What losing ``nodes`` (the domain ``domain`` of kind ``kind``) would leave without a home."""

    kind: str
    domain: str
    nodes: tuple[int, ...]
    lost: list[Allocation] = field(default_factory=list)
    """What ran on the domain's nodes."""
    placed: dict[str, Placement] = field(default_factory=dict)
    """Where each re-placed request went."""
    unplaced: list[Request] = field(default_factory=list)

    @property
    def lost_gpu_milli(self) -> int:
        return sum(a.request.total_gpu_milli for a in self.lost)

    @property
    def unplaced_gpu_milli(self) -> int:
        return sum(r.total_gpu_milli for r in self.unplaced)

    @property
    def covered(self) -> bool:
        """True when everything on the domain could be re-placed elsewhere."""
        return not self.unplaced

    @property
    def unplaced_share(self) -> float:
        """Share of the domain's GPU demand that could not be re-placed (0 when it held none)."""
        lost = self.lost_gpu_milli
        return self.unplaced_gpu_milli / lost if lost else 0.0


def failover_order(requests: Sequence[Request]) -> list[Request]:
    """Highest priority first, then the most GPU (cards, then milli), then the most CPU, then the name."""
    return sorted(requests, key=lambda r: (-r.priority, -r.num_gpu, -r.total_gpu_milli, -r.cpu_milli, r.name))


def evacuate(
    scheduler: Scheduler,
    nodes: Collection[int],
    *,
    kind: str = "node",
    domain: str = "",
    commit: bool = False,
) -> Evacuation:
    """Release everything on ``nodes`` and re-place it elsewhere (see the module docstring); rolled back unless
    ``commit``. With ``commit`` the unplaced requests hold nothing any more (the caller queues them)."""
    state = scheduler.state
    members = tuple(sorted(set(nodes)))
    result = Evacuation(kind, domain, members)
    result.lost = [a for i in members for a in state.on_node[i].values()]
    if not result.lost:
        return result
    excluded = set(members)
    with scheduler.transaction() as tx:
        for a in result.lost:
            tx.evict(a.request.name)
        for request in failover_order([replace(a.request, failover=True) for a in result.lost]):
            decision = scheduler.decide(request, exclude=excluded)
            if decision.placement is None:
                result.unplaced.append(request)
                continue
            tx.allocate(decision.request, decision.placement)
            result.placed[request.name] = decision.placement
        if commit:
            tx.commit()
    return result


def domain_coverage(scheduler: Scheduler, kind: str) -> list[Evacuation]:
    """:func:`evacuate` (rolled back) for every domain of ``kind`` whose nodes hold work, in fleet order."""
    state = scheduler.state
    out: list[Evacuation] = []
    for name, members in group_by_domain(state.nodes, kind).items():
        if any(state.on_node[i] for i in members):
            out.append(evacuate(scheduler, members, kind=kind, domain=name))
    return out
