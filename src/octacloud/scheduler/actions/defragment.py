"""Defragmentation: make room for a request that fits nowhere by moving running replicas elsewhere.

For a pending request, each usable node that could host it once some of its replicas left is a *target*. The
replicas considered for moving off a target are those the caller may move: never pinned ones unless allowed,
never ones of higher priority than the request unless allowed. On a target, sets of movers are tried in order
of size (1, 2, ... up to the move budget), smaller replicas first; the first set for which every mover finds a
destination on *another* node (chosen by the scheduler's own profile) and after which the request fits on the
target wins. Over targets, the fewest moves win, then the least milli-GPU moved, then the scheduler's node order.

Make-before-break: each move first *reserves* the destination (a shadow allocation named ``<replica>@move``
takes the resources while the source still holds its own), then releases the source, then turns the shadow into
the replica's allocation. In the cluster the replica is therefore never without a home: at every step it holds
its source, its destination, or both. Everything goes through a :class:`Transaction`; the plan is committed only
if the request is then placed, otherwise the state is rolled back exactly.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations, islice

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Placement, Request
from octacloud.scheduler.framework.index import NodeClasses
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import Allocation, ClusterState
from octacloud.scheduler.framework.transaction import Operation, Transaction

DEFAULT_MAX_MOVES = 4
"""Moves one defragmentation may make (per request; the loop also has a budget per pass)."""
DEFAULT_MAX_TARGETS = 4
"""Target nodes examined per request, the ones missing the least capacity first (bounds the cost)."""
DEFAULT_MAX_SETS_PER_TARGET = 8
"""Mover sets tried per target before giving up on it."""
SHADOW_SUFFIX = "@move"


@dataclass(frozen=True, slots=True)
class Move:
    """Replica ``request`` moved from ``source`` to ``destination`` (both placements of that replica)."""

    request: Request
    source: Placement
    destination: Placement


@dataclass(slots=True)
class Defragmentation:
    """The outcome: where the pending request went and which replicas moved to make room."""

    request: Request
    placement: Placement
    moves: list[Move] = field(default_factory=list)
    operations: list[Operation] = field(default_factory=list)


def defragment(
    scheduler: Scheduler,
    request: Request,
    *,
    max_moves: int = DEFAULT_MAX_MOVES,
    allow_pinned: bool = False,
    allow_higher_priority: bool = False,
    max_targets: int = DEFAULT_MAX_TARGETS,
    max_sets_per_target: int = DEFAULT_MAX_SETS_PER_TARGET,
    avoid: Collection[int] = (),
) -> Defragmentation | None:
    """Place ``request`` by moving at most ``max_moves`` replicas; ``None`` (state unchanged) when no plan works.

    A request that fits without moving anything is placed directly (no moves). Nodes in ``avoid`` (indices: the
    loop's reserved nodes) are neither targets nor destinations.
    """
    avoid = frozenset(avoid)
    if max_moves < 0:
        raise InvalidSpecError(f"defragment: max_moves must be >= 0, got {max_moves}")
    state = scheduler.state
    direct = scheduler.decide(request)
    if direct.placement is not None:
        with scheduler.transaction() as tx:
            tx.allocate(direct.request, direct.placement)
            operations = tx.commit()
        return Defragmentation(direct.request, direct.placement, [], operations)
    if max_moves == 0:
        return None

    def movable(a: Allocation) -> bool:
        r = a.request
        return (allow_pinned or not r.pinned) and (allow_higher_priority or r.priority <= request.priority)

    best: tuple[tuple[int, int, int], int, tuple[Allocation, ...]] | None = None
    for target in _targets(state, request, movable, max_targets, scheduler.node_classes, avoid):
        movers = sorted(
            (a for a in state.on_node[target].values() if movable(a)),
            key=lambda a: (a.request.total_gpu_milli, a.request.cpu_milli, a.request.name),
        )
        for k in range(1, min(max_moves, len(movers)) + 1):
            if best is not None and k > best[0][0]:
                break
            found = _first_working_set(scheduler, request, target, movers, k, max_sets_per_target, avoid)
            if found is not None:
                cost = (k, sum(a.request.total_gpu_milli for a in found), scheduler.tie_rank[target])
                if best is None or cost < best[0]:
                    best = (cost, target, found)
                break
    if best is None:
        return None
    _cost, target, movers_found = best
    with scheduler.transaction() as tx:
        moves = _apply_moves(scheduler, tx, movers_found, target, avoid)
        decision = scheduler.decide(request, [target]) if moves is not None else None
        if moves is None or decision is None or decision.placement is None:
            return None  # the context manager rolls back
        tx.allocate(decision.request, decision.placement)
        operations = tx.commit()
    return Defragmentation(decision.request, decision.placement, moves, operations)


def _targets(
    state: ClusterState,
    request: Request,
    movable: object,
    limit: int,
    classes: NodeClasses | None = None,
    avoid: Collection[int] = (),
) -> list[int]:
    """Usable nodes whose capacity could host ``request`` once their movable replicas left, least missing first."""
    assert callable(movable)
    need_gpu = request.total_gpu_milli
    ranked = _by_missing(state, request) if classes is None else _by_missing_per_class(state, request, classes)
    # Nodes come ranked by what they miss now (cheap); the movers of only as many as the limit needs are summed.
    out: list[int] = []
    for _missing, i in ranked:
        if len(out) >= limit:
            break
        node = state.nodes[i]
        if not state.node_usable[i] or node.gpu_count < request.num_gpu or i in avoid:
            continue
        if request.num_gpu and not any(request.allows_model(g.model) for g in node.gpus):
            continue
        movers = [a.request for a in state.on_node[i].values() if movable(a)]
        gpu = state.free_gpu_milli(i) + sum(r.total_gpu_milli for r in movers)
        cpu = state.free_cpu[i] + sum(r.cpu_milli for r in movers)
        mem = state.free_memory[i] + sum(r.memory_mib for r in movers)
        if not movers or gpu < need_gpu or cpu < request.cpu_milli or mem < request.memory_mib:
            continue
        out.append(i)
    return out


def _missing(state: ClusterState, request: Request, i: int) -> int:
    free_gpu = sum(state.signature[i].free_gpu)
    return max(0, request.total_gpu_milli - free_gpu) + max(0, request.cpu_milli - state.free_cpu[i])


def _by_missing(state: ClusterState, request: Request) -> Iterator[tuple[int, int]]:
    """(milli the node misses now, node) for every node, in that order."""
    return iter(sorted((_missing(state, request, i), i) for i in range(len(state))))


def _by_missing_per_class(state: ClusterState, request: Request, classes: NodeClasses) -> Iterator[tuple[int, int]]:
    """The same order as :func:`_by_missing`, computed once per class of equal nodes."""
    levels: dict[int, list[int]] = {}
    for cid in classes.nonempty:
        levels.setdefault(_missing(state, request, classes.first(cid)), []).append(cid)
    for missing in sorted(levels):
        for i in sorted(i for cid in levels[missing] for i in classes.members(cid)):
            yield missing, i


def _first_working_set(
    scheduler: Scheduler,
    request: Request,
    target: int,
    movers: Sequence[Allocation],
    k: int,
    limit: int,
    avoid: Collection[int] = (),
) -> tuple[Allocation, ...] | None:
    """The first set of ``k`` movers (in order) whose moves all succeed and after which ``request`` fits."""
    for chosen in islice(combinations(movers, k), limit):
        with scheduler.transaction() as tx:
            if _apply_moves(scheduler, tx, chosen, target, avoid) is None:
                continue
            if scheduler.decide(request, [target]).placement is not None:
                return chosen
        # leaving the block without commit rolled the trial back
    return None


def _apply_moves(
    scheduler: Scheduler, tx: Transaction, movers: Sequence[Allocation], target: int, avoid: Collection[int] = ()
) -> list[Move] | None:
    """Move each of ``movers`` off ``target``, make-before-break, inside ``tx``; ``None`` if one has no home."""
    moves: list[Move] = []
    exclude = {target, *avoid}
    for allocation in movers:
        move = move_off(scheduler, tx, allocation, exclude)
        if move is None:
            return None
        moves.append(move)
    return moves


def move_off(scheduler: Scheduler, tx: Transaction, allocation: Allocation, exclude: Collection[int]) -> Move | None:
    """Move one replica, make-before-break inside ``tx``, to where the scheduler's profile would place it outside
    the nodes ``exclude`` (indices; its own node must be among them); ``None`` (nothing done) if it has no home."""
    replica = allocation.request
    shadow = replace(replica, name=replica.name + SHADOW_SUFFIX)
    decision = scheduler.decide(shadow, exclude=exclude)
    if decision.placement is None:
        return None
    return move_to(tx, allocation, decision.request, decision.placement)


def move_to(tx: Transaction, allocation: Allocation, shadow: Request, destination: Placement) -> Move:
    """Move ``allocation``'s replica to ``destination`` (a placement of ``shadow``, the replica renamed
    ``<replica>@move``), make-before-break inside ``tx``: the shadow takes the destination while the source still
    holds, then the source is released, then the shadow becomes the replica's allocation."""
    replica = allocation.request
    tx.allocate(shadow, destination)  # reserve the destination: make ...
    source = tx.evict(replica.name).placement  # ... before break
    tx.evict(shadow.name)
    placement = replace(destination, request=replica.name)
    tx.allocate(replica, placement)
    return Move(replica, source, placement)


def shadow_of(replica: Request) -> Request:
    """The name under which a moving replica reserves its destination."""
    return replace(replica, name=replica.name + SHADOW_SUFFIX)
