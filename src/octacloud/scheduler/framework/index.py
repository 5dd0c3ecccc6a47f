"""Equivalence classes of nodes, so that a decision visits classes instead of nodes.

Two nodes are in one *class* when everything a node-local plugin may read about them is equal: the node's spec
(CPU, memory, cards with their models, memory, NVLink groups and health, labels, health) and what is free on it
(CPU, memory, milli-GPU and memory per card). Only the name differs. A node-local filter gives every member of a
class the same answer and a node-local scorer the same raw score, so the runner filters and scores one member per
class and places on the member that comes first in the profile's node order among the best classes — the same
node the exhaustive search over every node picks (``runner.py`` says when the runner may use this).

:class:`NodeClasses` keeps, as the state changes (it subscribes to :meth:`ClusterState.watch`):

* the class of every node, the size of every class, and per class a heap of its members by tie rank (lazily
  cleaned: a member that left stays in the heap until it reaches the top);
* a log of class size changes, from which a :class:`Feasibility` — per request shape, the verdict of the
  profile's filters on every class, how many nodes each filter drops and which non-empty classes pass — is
  brought up to date in time proportional to the changes since that shape was last asked about, not to the fleet.

A class key never changes meaning (it is the state itself), so a verdict once computed holds for as long as the
class ids do; they are renumbered only when more than :data:`MAX_CLASSES` keys were ever seen.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Sequence, Set
from dataclasses import dataclass, field

from octacloud.core.model import Node
from octacloud.scheduler.framework.state import ClusterState

ClassKey = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]
"""(spec id, free CPU milli, free memory MiB, free milli-GPU per card, free card memory MiB per card)."""

MAX_CLASSES = 1 << 18
"""Class keys remembered before the ids are renumbered (bounds memory over a long simulation)."""
LOG_LIMIT = 1 << 16
"""Size changes logged before the log restarts (feasibilities then recount from the classes)."""
MAX_SHAPES = 4096
"""Request shapes whose feasibility is kept."""

Evaluate = Callable[[list[int]], dict[int, int]]
"""Given class ids (all non-empty), the index of the first filter that drops each (``len(filters)``: passes)."""


@dataclass(slots=True)
class Feasibility:
    """The profile's filters on every class for one request shape, as of log position ``pos``."""

    epoch: int
    pos: int
    verdict: dict[int, int]
    """Class id → the first filter that drops it, ``passes`` when none does (valid for the ids' lifetime)."""
    passes: int
    dropped: list[int]
    """Per filter: nodes (in non-empty classes) it is the first to drop."""
    feasible: set[int] = field(default_factory=set)
    """Non-empty classes that every filter keeps."""


class NodeClasses:
    """The classes of a :class:`ClusterState`'s nodes, kept current, with members ordered by ``rank``."""

    def __init__(self, state: ClusterState, rank: Sequence[int]) -> None:
        if len(rank) != len(state):
            raise ValueError(f"tie ranks for {len(rank)} nodes, state has {len(state)}")
        self.state = state
        self.rank = rank
        self._build()
        state.watch(self.update)

    def _build(self) -> None:
        state = self.state
        self._ids: dict[ClassKey, int] = {}
        self._spec_ids: dict[Hashable, int] = {}
        self._specs: list[Node] = list(state.nodes)
        self._spec_of: list[int] = [self._spec_id(n) for n in self._specs]
        self.size: list[int] = []
        self._heaps: list[list[tuple[int, int]]] = []
        self.top: list[int] = []
        """Per class: its member first in the rank order, -1 when not known (then :meth:`first` finds it)."""
        self.nonempty: set[int] = set()
        self.of: list[int] = []
        for i in range(len(state)):
            cid = self._class_id(i)
            self.of.append(cid)
            self.size[cid] += 1
            self._heaps[cid].append((self.rank[i], i))
            self.nonempty.add(cid)
        for heap in self._heaps:
            heapq.heapify(heap)
        self.top = [heap[0][1] if heap else -1 for heap in self._heaps]
        self.left: list[int] = []
        """The log of class changes: the ``k``-th change moved a node from class ``left[k]`` to ``joined[k]``."""
        self.joined: list[int] = []
        self.epoch = getattr(self, "epoch", -1) + 1
        self.generation = getattr(self, "generation", -1) + 1
        """Bumped when class ids are renumbered (every verdict is void)."""
        self._shapes: dict[Hashable, Feasibility] = {}

    # ---- classes ---------------------------------------------------------------------------------------

    def _spec_id(self, node: Node) -> int:
        spec = (node.cpu_milli, node.memory_mib, node.gpus, tuple(sorted(node.labels.items())), node.health)
        sid = self._spec_ids.get(spec)
        if sid is None:
            sid = self._spec_ids[spec] = len(self._spec_ids)
        return sid

    def _class_id(self, i: int) -> int:
        state = self.state
        node = state.nodes[i]
        if node is not self._specs[i]:  # a health change replaced the node's spec
            self._specs[i] = node
            self._spec_of[i] = self._spec_id(node)
        key = (
            self._spec_of[i],
            state.free_cpu[i],
            state.free_memory[i],
            tuple(state.free_gpu[i]),
            tuple(state.free_gpu_memory[i]),
        )
        cid = self._ids.get(key)
        if cid is None:
            cid = self._ids[key] = len(self.size)
            self.size.append(0)
            self._heaps.append([])
            self.top.append(-1)
        return cid

    def update(self, i: int) -> None:
        """Node ``i`` changed: move it to its new class (called by the state)."""
        old, new = self.of[i], self._class_id(i)
        if new == old:
            return
        self.of[i] = new
        size, top, rank = self.size, self.top, self.rank
        size[old] -= 1
        if not size[old]:
            self.nonempty.discard(old)
        if top[old] == i:
            top[old] = -1
        size[new] += 1
        if size[new] == 1:
            self.nonempty.add(new)
            top[new] = i
        elif top[new] >= 0 and rank[i] < rank[top[new]]:
            top[new] = i
        heap = self._heaps[new]
        heapq.heappush(heap, (self.rank[i], i))
        if len(heap) > 2 * self.size[new] + 16:
            self._heaps[new] = heap = sorted({e for e in heap if self.of[e[1]] == new})
        self.left.append(old)
        self.joined.append(new)
        if len(self.joined) > LOG_LIMIT:
            self.left, self.joined = [], []
            self.epoch += 1
        if len(self.size) > MAX_CLASSES:
            self._build()

    def first(self, cid: int) -> int:
        """The member of the non-empty class ``cid`` first in the rank order."""
        t = self.top[cid]
        if t >= 0:
            return t
        heap, of = self._heaps[cid], self.of
        while heap and of[heap[0][1]] != cid:
            heapq.heappop(heap)
        if not heap:
            raise LookupError(f"node class {cid} is empty")
        t = self.top[cid] = heap[0][1]
        return t

    def members(self, cid: int) -> list[int]:
        """The nodes of class ``cid``, in no particular order."""
        of = self.of
        return list({node for _rank, node in self._heaps[cid] if of[node] == cid})

    def first_not_in(self, cid: int, excluded: Set[int]) -> int | None:
        """The member of class ``cid`` first in the rank order that is not in ``excluded`` (``None``: none is)."""
        if not self.size[cid]:
            return None
        t = self.first(cid)
        if t not in excluded:
            return t
        of = self.of
        for _rank, node in sorted(self._heaps[cid]):
            if of[node] == cid and node not in excluded:
                return node
        return None

    # ---- feasibility per request shape -------------------------------------------------------------------

    def feasibility(self, shape: Hashable, filters: int, evaluate: Evaluate) -> Feasibility:
        """The verdicts of ``filters`` filters for ``shape`` on every class, brought up to date."""
        f = self._shapes.get(shape)
        if f is not None and f.passes != filters:
            f = None
        if f is None or f.epoch != self.epoch or len(self.joined) - f.pos > len(self.nonempty):
            return self._recount(shape, filters, evaluate, f.verdict if f is not None else {})
        if f.pos == len(self.joined):
            return f
        net = Counter(self.joined[f.pos :])
        net.subtract(self.left[f.pos :])
        f.pos = len(self.joined)
        verdict = f.verdict
        unknown = [cid for cid, d in net.items() if d and cid not in verdict]  # empty when last counted
        if unknown:
            verdict.update(evaluate(unknown))
        size, feasible, dropped, passes = self.size, f.feasible, f.dropped, f.passes
        for cid, d in net.items():
            if not d:
                continue
            v = verdict[cid]
            if v < passes:
                dropped[v] += d
            elif size[cid]:
                feasible.add(cid)
            else:
                feasible.discard(cid)
        return f

    def _recount(self, shape: Hashable, filters: int, evaluate: Evaluate, verdict: dict[int, int]) -> Feasibility:
        if len(self._shapes) >= MAX_SHAPES:
            self._shapes.clear()
        unknown = [cid for cid in self.nonempty if cid not in verdict]
        if unknown:
            verdict.update(evaluate(unknown))
        f = Feasibility(self.epoch, len(self.joined), verdict, filters, [0] * filters)
        size = self.size
        for cid in self.nonempty:
            v = verdict[cid]
            if v < filters:
                f.dropped[v] += size[cid]
            else:
                f.feasible.add(cid)
        self._shapes[shape] = f
        return f
