"""A failover plan per failure domain: a backup spot outside its domain for every allocation.

Losing a domain (a rack, say) loses what runs on it; the cloud can re-place it only if, at that moment, room of
the right shape is free on the other domains. :class:`BackupPlan` keeps that room: every allocation on a node of
domain ``D`` gets a *backup* — a node outside ``D`` and the cards there on which it would run — and the capacity
the backups of one domain use on a node is that domain's *use* of the node. Only one domain fails at a time, so
the backups of different domains may share capacity: what a node holds *reserved* is, per card and for CPU and
memory, the most that any one domain's backups use there. Work that is not failover work may take only what is
free beyond that reservation (:meth:`BackupPlan.admits`), and only on a domain whose new allocation would itself
find a backup (:meth:`BackupPlan.has_backup`); then every domain stays covered.

A backup is chosen where it adds the least to the reservation (on a node whose reservation, by another domain,
already holds room of that shape, it adds nothing), then where it leaves the least free (it takes leftovers, not
whole nodes), then in node order. The plan follows the state by itself: it watches every node change
(``ClusterState.watch``) and, before it is next asked, drops the backups of allocations that left, plans the new
ones (largest first), moves backups off nodes that failed or whose free capacity fell below what they reserve
(failover work may take reserved room), and retries the allocations left without a backup once capacity came
back. Pure bookkeeping over a :class:`ClusterState`; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from octacloud.core.domains import domain_of
from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.state import Allocation, ClusterState


@dataclass(slots=True)
class Usage:
    """Capacity held on one node: CPU milli, memory MiB, and per card milli-GPU and memory MiB."""

    cpu: int
    memory: int
    gpu: list[int]
    gpu_memory: list[int]

    @classmethod
    def empty(cls, cards: int) -> Usage:
        return cls(0, 0, [0] * cards, [0] * cards)

    def is_empty(self) -> bool:
        return not (self.cpu or self.memory or any(self.gpu) or any(self.gpu_memory))


@dataclass(frozen=True, slots=True)
class Backup:
    """Where allocation ``name`` of domain ``domain`` would run if its domain failed."""

    name: str
    domain: str
    node: int
    cards: tuple[int, ...]
    request: Request


@dataclass(slots=True, weakref_slot=True)
class BackupPlan:
    """Backups for every allocation of ``state`` per domain of ``kind`` (see the module docstring)."""

    state: ClusterState
    kind: str = "rack"
    domain: list[str] = field(init=False)
    """Node index → its domain's name."""
    backups: dict[str, Backup] = field(init=False, default_factory=dict)
    uncovered: dict[str, Allocation] = field(init=False, default_factory=dict)
    """Allocations no backup could be found for (their domain is not covered)."""
    use: dict[int, dict[str, Usage]] = field(init=False, default_factory=dict)
    reserved: dict[int, Usage] = field(init=False, default_factory=dict)
    _known: list[set[str]] = field(init=False)
    _dirty: set[int] = field(init=False)
    changes: int = field(init=False, default=0)
    """Backups chosen since the plan was last made at once (:meth:`replan`)."""
    _scans: dict[tuple[object, ...], list[tuple[int, int, int, tuple[int, ...]]]] = field(init=False)

    def __post_init__(self) -> None:
        nodes = self.state.nodes
        self.domain = [domain_of(n, self.kind) for n in nodes]
        self._known = [set() for _ in nodes]
        self._dirty = set(range(len(nodes)))
        self._scans = {}
        self.state.watch(self._changed)

    @property
    def domains(self) -> int:
        return len(set(self.domain))

    def _changed(self, i: int) -> None:
        self._dirty.add(i)
        self._scans.clear()

    # ---- questions ---------------------------------------------------------------------------------------

    def admits(self, request: Request, node: int) -> bool:
        """True when ``request`` fits on ``node`` in what is free beyond the node's reservation."""
        reserved = self.reserved.get(node)
        return reserved is None or self.cards(request, node, reserved) is not None

    def has_backup(self, request: Request, domain: str, candidates: Sequence[int]) -> bool:
        """True when ``request``, placed on ``domain``, would find a backup outside it. ``candidates`` are nodes
        where it fits now (the search looks at those first: one off ``domain`` that ``domain`` uses nothing of
        is a backup at once)."""
        names = self.domain
        for m in candidates:
            if names[m] != domain and domain not in self.use.get(m, {}):
                return True
        return self._spot(request, domain) is not None

    def covered(self) -> bool:
        """True when every allocation has a backup."""
        self.sync()
        return not self.uncovered

    def uncovered_domains(self) -> dict[str, int]:
        """Domain → GPU milli of its allocations without a backup."""
        self.sync()
        out: dict[str, int] = {}
        for a in self.uncovered.values():
            d = self.domain[a.node_index]
            out[d] = out.get(d, 0) + a.request.total_gpu_milli
        return out

    def reserved_gpu_milli(self) -> int:
        return sum(sum(u.gpu) for u in self.reserved.values())

    # ---- keeping up with the state ---------------------------------------------------------------------

    def sync(self) -> None:
        """Bring the plan up to date with every node change since the last call (see the module docstring)."""
        if not self._dirty:
            return
        state, new, freed = self.state, [], False
        while self._dirty:
            dirty = sorted(self._dirty)
            self._dirty.clear()
            for i in dirty:
                here, known = state.on_node[i], self._known[i]
                for name in sorted(known - here.keys()):
                    known.discard(name)
                    self._drop(name)
                    freed = True
                for name in sorted(here.keys() - known):
                    known.add(name)
                    new.append(here[name])
                self._repair(i)
        for a in sorted(new, key=_largest_first):
            if a.request.name in state.allocations:
                self._plan(a)
        if freed and self.uncovered:
            for a in sorted(self.uncovered.values(), key=_largest_first):
                if a.request.name in state.allocations:
                    del self.uncovered[a.request.name]
                    self._plan(a)

    def replan(self) -> None:
        """Choose every backup again, the domains holding the most GPU first (each allocation largest first), so
        that the smaller domains' backups share the room the largest one reserved."""
        self.sync()
        self.backups.clear()
        self.uncovered.clear()
        self.use.clear()
        self.reserved.clear()
        by_domain: dict[str, list[Allocation]] = {}
        for a in self.state.allocations.values():
            by_domain.setdefault(self.domain[a.node_index], []).append(a)
        demand = {d: sum(a.request.total_gpu_milli for a in allocs) for d, allocs in by_domain.items()}
        for d in sorted(by_domain, key=lambda d: (-demand[d], d)):
            for a in sorted(by_domain[d], key=_largest_first):
                self._plan(a)
        self.changes = 0  # counted from here: the backups just chosen were chosen at once

    def _repair(self, i: int) -> None:
        """Move the backups on node ``i`` that no longer fit there (it failed, or its free capacity fell)."""
        uses = self.use.get(i)
        if not uses:
            return
        state = self.state
        usable = state.node_usable[i]
        broken = [d for d, u in uses.items() if not usable or not self._fits_within(i, u)]
        if not broken:
            return
        moved = [b for b in self.backups.values() if b.node == i and b.domain in broken]
        for b in moved:
            self._drop(b.name)
        again = [state.allocations[b.name] for b in moved if b.name in state.allocations]
        for a in sorted(again, key=_largest_first):
            self._plan(a)

    def _fits_within(self, i: int, u: Usage) -> bool:
        s = self.state
        if u.cpu > s.free_cpu[i] or u.memory > s.free_memory[i]:
            return False
        free, free_mem = s.signature[i].free_gpu, s.free_gpu_memory[i]
        return all(u.gpu[g] <= free[g] and u.gpu_memory[g] <= free_mem[g] for g in range(len(u.gpu)))

    # ---- planning ----------------------------------------------------------------------------------------

    def _plan(self, a: Allocation) -> None:
        domain = self.domain[a.node_index]
        spot = self._spot(a.request, domain)
        if spot is None:
            self.uncovered[a.request.name] = a
            return
        m, cards = spot
        self.changes += 1
        backup = Backup(a.request.name, domain, m, cards, a.request)
        self.backups[backup.name] = backup
        uses = self.use.setdefault(m, {})
        u = uses.setdefault(domain, Usage.empty(len(self.state.nodes[m].gpus)))
        _add(u, a.request, cards, +1)
        self._reserve(m)

    def _drop(self, name: str) -> None:
        self.uncovered.pop(name, None)
        backup = self.backups.pop(name, None)
        if backup is None:
            return
        uses = self.use[backup.node]
        u = uses[backup.domain]
        _add(u, backup.request, backup.cards, -1)
        if u.is_empty():
            del uses[backup.domain]
        if not uses:
            del self.use[backup.node]
        self._reserve(backup.node)

    def _reserve(self, m: int) -> None:
        uses = self.use.get(m)
        if not uses:
            self.reserved.pop(m, None)
            return
        cards = len(self.state.nodes[m].gpus)
        r = Usage.empty(cards)
        for u in uses.values():
            r.cpu, r.memory = max(r.cpu, u.cpu), max(r.memory, u.memory)
            for g in range(cards):
                r.gpu[g] = max(r.gpu[g], u.gpu[g])
                r.gpu_memory[g] = max(r.gpu_memory[g], u.gpu_memory[g])
        self.reserved[m] = r

    def _spot(self, request: Request, domain: str) -> tuple[int, tuple[int, ...]] | None:
        """The best backup for ``request`` of ``domain`` (module docstring), or None."""
        state, names = self.state, self.domain
        usable = state.node_usable
        best: tuple[tuple[int, int, int, int, int], int, tuple[int, ...]] | None = None
        for m in sorted(self.reserved):
            if names[m] == domain or not usable[m]:
                continue
            own = self.use[m].get(domain)
            cards = self.cards(request, m, own)
            if cards is None:
                continue
            key = (self._increase(m, domain, request, cards), 0, *self._leftover(request, m, cards), m)
            if best is None or key < best[0]:
                best = (key, m, cards)
        if best is not None and best[0][0] == 0:
            return best[1], best[2]
        need = request.total_gpu_milli * 1000 + request.cpu_milli
        for left_gpu, left_cpu, m, cards in self._fresh(request):
            if names[m] != domain and m not in self.reserved:
                key = (need, 1, left_gpu, left_cpu, m)
                if best is None or key < best[0]:
                    best = (key, m, cards)
                break  # the list is in key order: the first node left is the best fresh one
        return None if best is None else (best[1], best[2])

    def _fresh(self, request: Request) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """Every node where ``request`` fits in what is free now, the least left over first (cached per request
        shape until a node changes: a plan made at once, as :meth:`replan` makes it, scans the fleet once per
        shape). Least first, so that a new reservation takes a node's leftovers rather than a whole free node,
        which work that needs whole nodes would otherwise be refused."""
        shape = (request.num_gpu, request.gpu_milli, request.gpu_memory_mib, request.cpu_milli, request.memory_mib,
                 request.gpu_models)  # fmt: skip
        found = self._scans.get(shape)
        if found is None:
            found = []
            for m in range(len(self.state)):
                cards = self.cards(request, m, None)
                if cards is not None:
                    left_gpu, left_cpu = self._leftover(request, m, cards, reserved=False)
                    found.append((left_gpu, left_cpu, m, cards))
            found.sort()
            self._scans[shape] = found
        return found

    def _increase(self, m: int, domain: str, request: Request, cards: tuple[int, ...]) -> int:
        """How much more node ``m`` would hold reserved (milli-GPU weighs 1000 × a CPU milli)."""
        reserved = self.reserved[m]
        own = self.use[m].get(domain)
        gpu = 0
        for g in cards:
            now = own.gpu[g] if own is not None else 0
            gpu += max(0, now + request.gpu_milli - reserved.gpu[g])
        cpu = max(0, (own.cpu if own is not None else 0) + request.cpu_milli - reserved.cpu)
        return gpu * 1000 + cpu

    def _leftover(self, request: Request, m: int, cards: tuple[int, ...], reserved: bool = True) -> tuple[int, int]:
        """Free milli-GPU and CPU the node would have beyond its reservation and this backup (least first)."""
        s = self.state
        held = self.reserved.get(m) if reserved else None
        gpu = sum(s.signature[m].free_gpu) - (sum(held.gpu) if held else 0) - request.total_gpu_milli
        cpu = s.free_cpu[m] - (held.cpu if held else 0) - request.cpu_milli
        return gpu, cpu

    def cards(self, request: Request, m: int, held: Usage | None) -> tuple[int, ...] | None:
        """The cards of node ``m`` on which ``request`` fits in its free capacity minus ``held`` (``()`` for CPU
        only), or None: whole free cards (lowest first) for whole-card requests, the fullest fitting card for a
        share."""
        s = self.state
        sig = s.signature[m]
        free = sig.free_gpu
        whole = request.num_gpu > 1 or request.gpu_milli == MILLI_PER_GPU
        if request.cpu_milli > sig.free_cpu or request.memory_mib > sig.free_memory or not s.node_usable[m]:
            return None  # the quick test on what is free at all (``held`` only takes more away)
        if request.num_gpu and (
            free.count(MILLI_PER_GPU) < request.num_gpu if whole else max(free, default=0) < request.gpu_milli
        ):
            return None
        if held is not None and (
            request.cpu_milli > sig.free_cpu - held.cpu or request.memory_mib > sig.free_memory - held.memory
        ):
            return None
        if request.num_gpu == 0:
            return ()
        gpus = s.nodes[m].gpus
        free_mem = s.free_gpu_memory[m]
        fitting: list[tuple[int, int]] = []
        for g in range(len(gpus)):
            left = free[g] - (held.gpu[g] if held else 0)
            left_mem = free_mem[g] - (held.gpu_memory[g] if held else 0)
            if left >= request.gpu_milli and left_mem >= request.gpu_memory_mib and request.allows_model(gpus[g].model):
                fitting.append((left, g))
        if whole:
            cards = [g for left, g in fitting if left == MILLI_PER_GPU]
            return tuple(cards[: request.num_gpu]) if len(cards) >= request.num_gpu else None
        return (min(fitting)[1],) if fitting else None


def _add(u: Usage, request: Request, cards: tuple[int, ...], sign: int) -> None:
    u.cpu += sign * request.cpu_milli
    u.memory += sign * request.memory_mib
    for g in cards:
        u.gpu[g] += sign * request.gpu_milli
        u.gpu_memory[g] += sign * request.gpu_memory_mib


def _largest_first(a: Allocation) -> tuple[int, int, int, str]:
    r = a.request
    return (-r.num_gpu, -r.total_gpu_milli, -r.cpu_milli, r.name)
