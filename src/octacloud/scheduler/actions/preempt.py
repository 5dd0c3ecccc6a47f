"""Preemption: make room for a request that fits nowhere by evicting cheaper, strictly lower-priority work.

For each usable node, the victims considered are allocations of strictly lower priority (pinned ones only when
allowed). A node qualifies when evicting all of them would let the request fit under the scheduler's own
profile (filters, rules and card choice included). On a qualifying node the cheapest victim set is searched in
order of increasing size; the cost of a set is, in order: number of victims, highest victim priority, sum of
priorities, milli-GPU evicted. The cheapest set over all nodes wins (ties: the scheduler's node order).

The plan is applied through a :class:`Transaction`: victims are evicted, the request is placed, and only if the
placement succeeds is it committed; otherwise everything is rolled back. The victims are returned for
re-placement by the caller (they are *not* re-placed here: that is the caller's policy).

:func:`victims_on_node` is the same search on one node, changing nothing: for a caller that evicts through
someone else (the Kubernetes extender answers kube-scheduler's preemption with it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations, islice

from octacloud.core.model import Placement, Request
from octacloud.scheduler.framework.runner import Decision, Scheduler
from octacloud.scheduler.framework.state import Allocation
from octacloud.scheduler.framework.transaction import Operation

DEFAULT_MAX_VICTIMS = 8
DEFAULT_MAX_SETS_PER_NODE = 512
"""Victim sets tried per node before giving up on it (bounds the search on crowded nodes)."""

_Cost = tuple[int, int, int, int, int]


@dataclass(slots=True)
class Preemption:
    """The outcome: where the request went and whom it displaced (empty when it fit without preemption)."""

    request: Request
    placement: Placement
    victims: list[Allocation] = field(default_factory=list)
    operations: list[Operation] = field(default_factory=list)


def preempt(
    scheduler: Scheduler,
    request: Request,
    *,
    allow_pinned: bool = False,
    max_victims: int = DEFAULT_MAX_VICTIMS,
    max_sets_per_node: int = DEFAULT_MAX_SETS_PER_NODE,
) -> Preemption | None:
    """Place ``request``, evicting the cheapest set of lower-priority work on one node if it fits nowhere.

    Returns ``None`` (and changes nothing) when no victim set on any node makes it fit.
    """
    state = scheduler.state
    decision = scheduler.decide(request)
    if decision.placement is not None:
        scheduler.commit(decision.request, decision.placement)
        return Preemption(decision.request, decision.placement)
    best: tuple[_Cost, int, tuple[Allocation, ...]] | None = None
    for node in range(len(state)):
        if not state.usable(node):
            continue
        victims = _cheapest_on(scheduler, request, node, allow_pinned, max_victims, max_sets_per_node, best)
        if victims:
            best = (_cost(victims, scheduler.tie_rank[node]), node, victims)
    if best is None:
        return None
    _, node, victims = best
    with scheduler.transaction() as tx:
        evicted = [tx.evict(v.request.name) for v in victims]
        placed = scheduler.decide(request, [node])
        if placed.placement is None:  # cannot happen: the same check passed above; roll back to be safe
            return None
        tx.allocate(placed.request, placed.placement)
        operations = tx.commit()
    return Preemption(placed.request, placed.placement, evicted, operations)


def victims_on_node(
    scheduler: Scheduler,
    request: Request,
    node: int,
    *,
    allow_pinned: bool = False,
    max_victims: int = DEFAULT_MAX_VICTIMS,
    max_sets_per_node: int = DEFAULT_MAX_SETS_PER_NODE,
) -> tuple[Allocation, ...] | None:
    """The cheapest set of strictly lower-priority allocations on ``node`` whose eviction lets ``request`` fit
    there, by the same search and cost as :func:`preempt`: ``()`` when it fits without evicting anything, None
    when no set makes it fit. Changes nothing (for a caller that evicts by other means, such as kube-scheduler).
    """
    if not scheduler.state.usable(node):
        return None
    if scheduler.decide(request, [node]).placement is not None:
        return ()
    return _cheapest_on(scheduler, request, node, allow_pinned, max_victims, max_sets_per_node, None) or None


def _cheapest_on(
    scheduler: Scheduler,
    request: Request,
    node: int,
    allow_pinned: bool,
    max_victims: int,
    max_sets: int,
    best: tuple[_Cost, int, tuple[Allocation, ...]] | None,
) -> tuple[Allocation, ...]:
    """The cheapest fitting victim set on ``node`` that costs less than ``best`` (``()``: none)."""
    candidates = _candidates(scheduler, request, node, allow_pinned)
    if not candidates or _try(scheduler, request, node, candidates) is None:
        return ()
    for victims in _victim_sets(candidates, max_victims, max_sets):
        if best is not None and _cost(victims, scheduler.tie_rank[node]) >= best[0]:
            continue
        if _try(scheduler, request, node, victims) is not None:
            return victims  # sets come in increasing size, cheapest first within a size
    return ()


def _candidates(scheduler: Scheduler, request: Request, node: int, allow_pinned: bool) -> list[Allocation]:
    found = [
        a
        for a in scheduler.state.on_node[node].values()
        if a.request.priority < request.priority and (allow_pinned or not a.request.pinned)
    ]
    found.sort(key=lambda a: (a.request.priority, a.request.total_gpu_milli, a.request.name))
    return found


def _victim_sets(candidates: Sequence[Allocation], max_victims: int, limit: int) -> Iterator[tuple[Allocation, ...]]:
    def sized(k: int) -> list[tuple[Allocation, ...]]:
        return sorted(islice(combinations(candidates, k), limit), key=lambda s: _cost(s, 0))

    produced = 0
    for k in range(1, min(max_victims, len(candidates)) + 1):
        for s in sized(k):
            if produced >= limit:
                return
            produced += 1
            yield s


def _cost(victims: Sequence[Allocation], rank: int) -> _Cost:
    priorities = [v.request.priority for v in victims]
    return (
        len(victims),
        max(priorities),
        sum(priorities),
        sum(v.request.total_gpu_milli for v in victims),
        rank,
    )


def _try(scheduler: Scheduler, request: Request, node: int, victims: Sequence[Allocation]) -> Decision | None:
    """Would ``request`` fit on ``node`` with ``victims`` gone? The state is restored before returning."""
    with scheduler.transaction() as tx:
        for v in victims:
            tx.evict(v.request.name)
        decision = scheduler.decide(request, [node])
        tx.rollback()
    return decision if decision.placement is not None else None
