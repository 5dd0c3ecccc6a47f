"""The demand terms of the ``octacloud`` plugin (:mod:`octacloud.scheduler.plugins.octacloud`): what a placement
takes from the requests still to come.

* ``R`` (:func:`scarcity_costs`): capacity taken on a GPU model that the workload's requests restricted to it will
  miss;
* ``M`` (:class:`WholeCardDemand`): whole cards taken from the multi-card requests, with the totals it needs kept
  per node and updated only where a node changed.

Both are in milli-GPU, the unit of ``F``, ``S`` and ``D``. Not a plugin of its own: the ``octacloud`` plugin
holds one ``WholeCardDemand`` and calls both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.state import ClusterState, NodeSignature

MultiClass = tuple[int, int, frozenset[str], int, float]
"""A multi-card request class: (cards, CPU milli, allowed GPU models, median memory MiB, share of GPU demand)."""
Restricted = tuple[frozenset[str], float, float]
"""Requests restricted to a set of GPU models: (the models, share of GPU demand, size moment E[X²]/E[X])."""

NEGLIGIBLE = 1e-4
"""A chance below this is no cost (saves the per-node pass while multi-card capacity is plentiful)."""
CACHE_LIMIT = 1 << 17


def scarcity_costs(restricted: Sequence[Restricted], state: ClusterState) -> dict[str, float]:
    """``R`` per milli-GPU on each GPU model: the chance that capacity taken on the model now is capacity the
    workload's restricted requests will miss.

    The requests still to come are taken to ask for what is free now (``free``, all models), drawn from the
    workload: the requests restricted to a model set ``A`` ask for ``q_A · free`` (``q_A``: their share of
    the workload's GPU demand), spread over ``A``'s models in proportion to what each has free. On a model
    ``M`` that gives a restricted demand with mean ``μ_M`` and variance ``σ²_M = Σ q_A-parts · E[X²]/E[X]``
    (a compound Poisson count of requests of size ``X``); the chance that it exceeds what ``M`` has free is
    ``Φ((μ_M − free_M) / σ_M)``. A placement of ``g`` milli-GPU on ``M`` then displaces about ``g`` times
    that chance of restricted demand, which fails and leaves as much idle elsewhere: ``R = g · Φ(…)``, the
    same unit as ``F``, ``S`` and ``D``. Workloads without restricted requests have no ``R``.
    """
    free = state.free_gpu_milli_by_model()  # kept by the state as it changes: no walk over every node
    total = sum(free.values())
    mean: dict[str, float] = {}
    variance: dict[str, float] = {}
    for models, share, moment in restricted:
        free_set = sum(free.get(m, 0) for m in models)
        if free_set <= 0:
            continue
        demand = share * total
        for m in models:
            part = demand * free.get(m, 0) / free_set
            mean[m] = mean.get(m, 0.0) + part
            variance[m] = variance.get(m, 0.0) + part * moment
    costs: dict[str, float] = {}
    for m, mu in mean.items():
        sd = math.sqrt(variance[m])
        if sd > 0:
            costs[m] = 0.5 * math.erfc((free.get(m, 0) - mu) / (sd * math.sqrt(2.0)))
    return costs


class WholeCardDemand:
    """``M``: the multi-card requests to come, the copies of each class the nodes can still host, and what a
    placement that removes copies costs them."""

    __slots__ = ("_cache", "_free_node", "_node", "_seen", "_state", "classes", "copies_total", "free_total", "waiting")

    def __init__(self, classes: tuple[MultiClass, ...]) -> None:
        self.classes = classes
        self._cache: dict[NodeSignature, tuple[int, ...]] = {}
        self._state: ClusterState | None = None
        self._seen: list[int] = []
        self._node: list[tuple[int, ...]] = []
        self.copies_total: list[int] = []
        """Copies of each class the whole state can host (kept by :meth:`costs`)."""
        self.waiting = [0] * len(classes)
        """Milli-GPU of each class waiting in the loop's queue (:meth:`observe_queue`)."""
        self._free_node: list[int] = []
        self.free_total = 0
        """Free milli-GPU of the whole state (kept by :meth:`costs`)."""

    def copies(self, sig: NodeSignature) -> tuple[int, ...]:
        """How many requests of each multi-card class a node in state ``sig`` can still host: its whole free
        cards, CPU and memory divided by the class's (0 where its model is not allowed)."""
        value = self._cache.get(sig)
        if value is None:
            model, cpu, memory, free = sig
            whole = sum(1 for f in free if f >= MILLI_PER_GPU)
            value = tuple(
                0
                if models and model not in models
                else min(
                    whole // cards,
                    max(cpu, 0) // cpu_milli if cpu_milli else whole,
                    max(memory, 0) // mib if mib else whole,
                )
                for cards, cpu_milli, models, mib, _ in self.classes
            )
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
            self._cache[sig] = value
        return value

    def lost(self, before: NodeSignature, after: NodeSignature) -> tuple[int, ...]:
        """Copies of each class a node loses going from ``before`` to ``after`` (``()`` without classes)."""
        if not self.classes:
            return ()
        return tuple(b - a for b, a in zip(self.copies(before), self.copies(after), strict=True))

    def observe_queue(self, pending: Sequence[Request]) -> None:
        """Record the multi-card demand that waits: each queued request of two or more whole cards counts toward
        its class (the class of the same cards and models with the nearest CPU request) in ``M``'s mean."""
        waiting = [0] * len(self.classes)
        for r in pending:
            if r.num_gpu < 2 or r.gpu_milli < MILLI_PER_GPU:
                continue
            best: tuple[int, int] | None = None
            for k, (cards, cpu_milli, models, _mib, _share) in enumerate(self.classes):
                if cards == r.num_gpu and models == r.gpu_models:
                    d = abs(cpu_milli - r.cpu_milli)
                    if best is None or d < best[0]:
                        best = (d, k)
            if best is not None:
                waiting[best[1]] += r.num_gpu * MILLI_PER_GPU
        self.waiting = waiting

    def costs(self, state: ClusterState) -> tuple[float, ...]:
        """``M`` per copy of each multi-card class a placement removes: ``cards × 1000 × Φ((μ − C) / σ)``, or
        ``()`` while every chance is negligible.

        As for ``R``, the requests to come are taken to ask for what is free now, drawn from the workload: class
        ``k`` (``cards`` whole cards on one node, its CPU and memory) asks for ``μ_k = q_k · free + w_k`` milli-GPU
        (``q_k``: its share of the GPU demand; ``w_k``: what of the class waits in the loop's queue, the live
        demand, :meth:`observe_queue`), with ``σ²_k = μ_k · cards · 1000``; the cluster can host ``C_k``
        milli-GPU of it (the copies that nodes' whole free cards, CPU and memory still take, × cards × 1000). A
        placement that removes a copy risks one request of the class with chance ``Φ((μ_k − C_k) / σ_k)``; that
        request fails and leaves its cards' worth idle. Totals are kept per node and updated only on the nodes
        whose version changed since the last decision.
        """
        self._track(state)
        costs: list[float] = []
        total = float(self.free_total)
        for (cards, _cpu, _models, _mib, share), hosted, waiting in zip(
            self.classes, self.copies_total, self.waiting, strict=True
        ):
            size = cards * MILLI_PER_GPU
            mean = share * total + waiting
            chance = 0.0
            if mean > 0:
                chance = 0.5 * math.erfc((hosted * size - mean) / (math.sqrt(2.0 * mean * size)))
            costs.append(size * chance if chance >= NEGLIGIBLE else 0.0)
        return tuple(costs) if any(costs) else ()

    def _track(self, state: ClusterState) -> None:
        sigs, versions = state.signature, state.version
        if state is not self._state or len(self._seen) != len(sigs):
            self._state = state
            self._seen = list(versions)
            self._node = [self.copies(sig) for sig in sigs]
            self.copies_total = [sum(c[k] for c in self._node) for k in range(len(self.classes))]
            self._free_node = [sum(sig.free_gpu) for sig in sigs]
            self.free_total = sum(self._free_node)
            return
        seen = self._seen
        for i in [i for i, (a, b) in enumerate(zip(versions, seen, strict=True)) if a != b]:
            seen[i] = versions[i]
            new = self.copies(sigs[i])
            old = self._node[i]
            for k in range(len(new)):
                self.copies_total[k] += new[k] - old[k]
            self._node[i] = new
            free = sum(sigs[i].free_gpu)
            self.free_total += free - self._free_node[i]
            self._free_node[i] = free
