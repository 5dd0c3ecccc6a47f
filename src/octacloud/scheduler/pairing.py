"""Share pairing's view of the state (:meth:`octacloud.scheduler.loop.ReevaluationLoop._pair_shares`): the shares
alone on their card that may move, the remainders they could fill, and the one a share fills best. Queries only:
the loop moves and starts, in a transaction."""

from __future__ import annotations

from collections.abc import Sequence

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.state import Allocation, ClusterState
from octacloud.scheduler.plugins.fit import cards_that_fit

Card = tuple[int, int]
"""(node index, card index)."""


def lone_shares(
    state: ClusterState, avoid: set[int], allow_pinned: bool, top: int
) -> tuple[list[tuple[Card, Allocation]], dict[Card, int]]:
    """What share pairing may move, and where to: each share alone on its card (movable: not pinned unless
    allowed, priority at most ``top``), largest first; and each card's free remainder (neither empty nor whole).
    Nodes in ``avoid`` and unusable nodes are neither."""
    occupants: dict[Card, list[Allocation]] = {}
    for i in range(len(state)):
        if i in avoid or not state.node_usable[i]:
            continue
        for a in state.on_node[i].values():
            for g in a.placement.gpus:
                occupants.setdefault((i, g), []).append(a)
    remainders = {card: state.free_gpu[card[0]][card[1]] for card in occupants}
    remainders = {card: f for card, f in remainders.items() if 0 < f < MILLI_PER_GPU}
    lone = [
        (card, group[0])
        for card, group in occupants.items()
        if len(group) == 1
        and group[0].request.is_sharing
        and (allow_pinned or not group[0].request.pinned)
        and group[0].request.priority <= top
    ]
    lone.sort(key=lambda item: (-item[1].request.gpu_milli, item[1].request.name))
    return lone, remainders


def best_remainder(
    state: ClusterState, r: Request, node: int, remainders: dict[Card, int], rank: Sequence[int]
) -> Card | None:
    """The remainder off ``node`` that ``r`` fills best (least left, then the runner's node order, then the
    card), where its CPU, memory and card constraints fit; None if none does."""
    best: tuple[tuple[int, int, int], Card] | None = None
    for (j, h), free in remainders.items():
        if j == node or free < r.gpu_milli:
            continue
        if state.free_cpu[j] < r.cpu_milli or state.free_memory[j] < r.memory_mib:
            continue
        if h not in cards_that_fit(state, r, j):  # the card's memory, model and health, as placement has them
            continue
        key = (free - r.gpu_milli, rank[j], h)
        if best is None or key < best[0]:
            best = (key, (j, h))
    return None if best is None else best[1]
