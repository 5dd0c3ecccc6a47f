"""Reservations: the head of the queue holds the node where it will fit soonest (backfilling with a reservation).

Without them a queue served oldest-first once per pass loses to whatever is placed in between: every card a
departure frees is taken by the next small request before the pass reaches the multi-card request at the head,
which then waits for ever. A :class:`Reservation` names, for one pending request that fits nowhere, a node and
the cards it will take there once the replicas on those cards (its *blockers*) have left. Other requests of no
higher priority may still use that node — *backfill* — but only where they do not delay the reservation:

* never one of the reserved cards;
* only the CPU and memory that stay spare for the holder: after the backfill, what is free plus what the blockers
  hold must still cover the holder's request (:func:`conflicts`).

The node chosen (:func:`choose`) is the one where the holder will fit soonest without knowing lifetimes: the
fewest blockers that the loop may not move (pinned, higher priority), then (when the loop defragments) the least
GPU held by whole-card blockers, then the fewest blockers, then the least GPU they hold, then the scheduler's
node order. With memoryless departures the expected wait grows with the
number of blockers; with defragmentation the blockers are exactly the replicas to move.

A holder that needs more of the node's CPU or memory than the replicas on its cards give back (an eight-card
request of 120 of a node's 128 cores, on a node where CPU-only work runs) also counts the fewest of the node's
other replicas whose CPU and memory cover the rest (the largest first) among its blockers, and backfill may not
take their CPU and memory once they leave. Without them such a request had no candidate node while every node
of its kind ran a little CPU-only work, so it never held a reservation and the younger multi-card requests
behind it took each one in turn.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from octacloud.core.model import Placement, Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.state import ClusterState


@dataclass(frozen=True, slots=True)
class Reservation:
    """``request`` (pending) holds ``cards`` of node ``node`` (an index); ``blocking`` replicas were still on
    them at pass ``made`` (when it was made, or last came closer: a blocker left)."""

    request: Request
    node: int
    cards: tuple[int, ...]
    made: int
    blocking: int
    others: frozenset[str] = frozenset()
    """Replicas off the reserved cards that must leave too: the holder needs their CPU or memory."""

    def blockers(self, state: ClusterState) -> list[str]:
        """Names of the replicas that must leave before the holder fits: those on the reserved cards, and the
        ``others`` still there."""
        cards, others = set(self.cards), self.others
        return [
            name
            for name, a in state.on_node[self.node].items()
            if name in others or cards.intersection(a.placement.gpus)
        ]

    def fits_now(self, state: ClusterState) -> bool:
        """True when every reserved card is whole and free and the node's CPU and memory cover the holder."""
        r = self.request
        free = state.free_gpu[self.node]
        mem = state.free_gpu_memory[self.node]
        return (
            state.node_usable[self.node]
            and all(free[g] == MILLI_PER_GPU and mem[g] >= r.gpu_memory_mib for g in self.cards)
            and state.free_cpu[self.node] >= r.cpu_milli
            and state.free_memory[self.node] >= r.memory_mib
        )


def _spare(state: ClusterState, reservation: Reservation) -> tuple[int, int]:
    """(CPU milli, memory MiB) that the node can give away and still host the holder once its blockers left."""
    cpu, mem = state.free_cpu[reservation.node], state.free_memory[reservation.node]
    allocations = state.on_node[reservation.node]
    for name in reservation.blockers(state):
        cpu += allocations[name].request.cpu_milli
        mem += allocations[name].request.memory_mib
    return cpu - reservation.request.cpu_milli, mem - reservation.request.memory_mib


def conflicts(state: ClusterState, reservation: Reservation, request: Request, placement: Placement) -> bool:
    """True when placing ``request`` at ``placement`` (on the reserved node) would delay the reservation."""
    if set(placement.gpus).intersection(reservation.cards):
        return True
    cpu, mem = _spare(state, reservation)
    return request.cpu_milli > cpu or request.memory_mib > mem


def choose(
    state: ClusterState,
    request: Request,
    *,
    made: int,
    taken: Collection[int],
    movable: object,
    rank: list[int],
    moves: bool = False,
) -> Reservation | None:
    """The reservation for pending ``request`` on the node, not in ``taken``, where it will fit soonest.

    ``movable(allocation)`` tells whether the loop may move a replica (it is then a cheaper blocker: it leaves by
    defragmentation as well as by departure). With ``moves`` (the loop defragments) the blockers that hold whole
    cards count first: a share moves into a fragment elsewhere, while a whole-card blocker needs whole free cards
    that the queue is short of. Where the replicas on its cards do not give back enough CPU or memory, the
    fewest other replicas of the node that do (the largest first) are blockers too. ``None`` when no node can
    host the holder, or for a request that takes no whole card (a share or a CPU-only request fits in what any
    departure frees).
    """
    assert callable(movable)
    n = request.num_gpu
    if n == 0 or (n == 1 and request.gpu_milli < MILLI_PER_GPU):
        return None
    best: tuple[tuple[int, int, int, int, int], int, tuple[int, ...], frozenset[str]] | None = None
    for i, node in enumerate(state.nodes):
        if i in taken or not state.node_usable[i] or node.gpu_count < n:
            continue
        if node.cpu_milli < request.cpu_milli or node.memory_mib < request.memory_mib:
            continue
        on_cards = _on_cards(state, request, i)
        if on_cards is None:
            continue
        chosen, blockers = on_cards
        allocations = state.on_node[i]
        others = _other_blockers(state, request, i, blockers)
        if others is None:
            continue
        blockers.update(others)
        fixed = sum(1 for b in blockers if not movable(allocations[b]))
        held = sum(allocations[b].request.total_gpu_milli for b in blockers)
        whole = sum(allocations[b].request.total_gpu_milli for b in blockers if not allocations[b].request.is_sharing)
        cost = (fixed, whole if moves else 0, len(blockers), held, rank[i])
        if best is None or cost < best[0]:
            best = (cost, i, chosen, frozenset(others))
    if best is None:
        return None
    return Reservation(request, best[1], best[2], made, best[0][2], best[3])


def _on_cards(state: ClusterState, request: Request, i: int) -> tuple[tuple[int, ...], set[str]] | None:
    """The cards of node ``i`` that ``request`` would hold (those the fewest replicas, then the least GPU, are
    on) and the replicas on them; ``None`` when too few of its cards can host the request."""
    node = state.nodes[i]
    per_card: dict[int, list[str]] = {}
    for name, a in state.on_node[i].items():
        for g in a.placement.gpus:
            per_card.setdefault(g, []).append(name)
    cards = [
        g
        for g, gpu in enumerate(node.gpus)
        if state.card_usable(i, g) and request.allows_model(gpu.model) and gpu.memory_mib >= request.gpu_memory_mib
    ]
    if len(cards) < request.num_gpu:
        return None
    free = state.free_gpu[i]
    cards.sort(key=lambda g: (len(per_card.get(g, ())), MILLI_PER_GPU - free[g], g))
    chosen = tuple(sorted(cards[: request.num_gpu]))
    return chosen, {name for g in chosen for name in per_card.get(g, ())}


def _other_blockers(state: ClusterState, request: Request, i: int, blockers: set[str]) -> list[str] | None:
    """The fewest other replicas of node ``i`` (the largest first) whose CPU and memory, with what is free and
    what ``blockers`` give back, cover ``request``; empty when those already do, ``None`` when not even all do."""
    allocations = state.on_node[i]
    cpu = state.free_cpu[i] + sum(allocations[b].request.cpu_milli for b in blockers)
    mem = state.free_memory[i] + sum(allocations[b].request.memory_mib for b in blockers)
    others: list[str] = []
    if cpu >= request.cpu_milli and mem >= request.memory_mib:
        return others
    rest = sorted(
        (name for name in allocations if name not in blockers),
        key=lambda name: (-allocations[name].request.cpu_milli, -allocations[name].request.memory_mib, name),
    )
    for name in rest:
        if cpu >= request.cpu_milli and mem >= request.memory_mib:
            break
        others.append(name)
        cpu += allocations[name].request.cpu_milli
        mem += allocations[name].request.memory_mib
    if cpu < request.cpu_milli or mem < request.memory_mib:
        return None
    return others
