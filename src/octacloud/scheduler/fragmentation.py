"""GPU fragmentation as the FGD paper measures it (Weng et al., USENIX ATC'23), computed exactly as the authors'
simulator does, with caches that make it cheap enough to evaluate after every placement.

A *target workload* is a distribution over task shapes ``(cpu_milli, gpu_milli, num_gpu, gpu_models)``. A node's
fragmentation is the expected idle milli-GPU that a task drawn from that workload could not use:

* a CPU-only shape, or a shape whose GPU models exclude the node, counts all idle GPU of the node as fragment;
* a GPU shape that fits the node (enough cards with ``free >= gpu_milli``, enough CPU) counts the idle milli-GPU
  of the cards too small for it (``free < gpu_milli``);
* a GPU shape that does not fit (too few such cards, or too little CPU) counts all idle GPU.

Only CPU and milli-GPU matter (the authors' model ignores memory). The value depends on a node's free CPU only
through which shape CPU thresholds it meets, and on its cards only through the multiset of free milli-GPU, so
results are cached on ``(model class, CPU threshold bucket, sorted free cards)``: nodes that differ in card order,
memory or CPU within a bucket share one entry.

The per-shape contributions are summed in the authors' order (by fragment kind, then by shape) so that the
floating-point result, and hence FGD's integer-truncated score, matches theirs bit for bit.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.state import ClusterState

_CACHE_LIMIT = 1 << 18
"""Entries kept per fragmentation cache before it is cleared (bounds memory on long churn runs)."""


@dataclass(frozen=True, slots=True, order=True)
class WorkloadShape:
    """One task shape of a target workload (``gpu_milli`` is per card; ``num_gpu`` cards)."""

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    gpu_models: frozenset[str] = frozenset()

    @classmethod
    def of(cls, request: Request) -> WorkloadShape:
        return cls(request.cpu_milli, request.gpu_milli, request.num_gpu, request.gpu_models)

    @property
    def spec(self) -> str:
        """The allowed GPU models as the traces write them (``A|B``, sorted; empty = any)."""
        return "|".join(sorted(self.gpu_models))


@dataclass(frozen=True, slots=True)
class TargetWorkload:
    """A distribution over task shapes: ``probabilities[k]`` is the chance of ``shapes[k]``.

    ``memory_mib[k]``, when given, is the typical (median) host memory of ``shapes[k]``'s tasks. FGD's measure
    ignores memory (as the authors' does); octacloud's stranding term uses it. Empty: memory unknown.

    ``share_sizes`` is every one-card share size (milli-GPU below one card) with its weight: what can fill a shared
    card's remainder (octacloud's dead-space term). ``from_requests`` records the requests' sizes, those of the
    shapes left out by the coverage included; when not given it is derived from the shapes.

    ``restricted_demand`` is, per set of allowed GPU models (``gpu_spec``), the share of the workload's GPU request
    restricted to exactly that set and the size moment ``E[X²]/E[X]`` (milli-GPU) of those requests' GPU demand
    ``X``: what octacloud's scarcity term reserves on each model. ``from_requests`` records it from all requests;
    when not given it is derived from the shapes. Empty when no request is restricted.

    ``multi_demand`` is, per multi-card request class ``(cards, CPU, allowed models)``, the class's median memory
    and its share of the workload's GPU demand: what octacloud's multi-card term keeps whole cards for. Recorded
    from all requests by ``from_requests`` (rare classes included: an eight-card request is rare by count, not by
    GPU); when not given it is derived from the shapes.
    """

    shapes: tuple[WorkloadShape, ...]
    probabilities: tuple[float, ...]
    memory_mib: tuple[int, ...] = ()
    share_sizes: tuple[tuple[int, float], ...] = ()
    restricted_demand: tuple[tuple[frozenset[str], float, float], ...] = ()
    multi_demand: tuple[tuple[int, int, frozenset[str], int, float], ...] = ()

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.probabilities):
            raise InvalidSpecError(
                f"target workload: {len(self.shapes)} shapes but {len(self.probabilities)} probabilities"
            )
        if self.memory_mib and len(self.memory_mib) != len(self.shapes):
            raise InvalidSpecError(f"target workload: {len(self.shapes)} shapes but {len(self.memory_mib)} memories")
        if any(m < 0 for m in self.memory_mib):
            raise InvalidSpecError("target workload: memory must be >= 0 MiB")
        if not self.shapes:
            raise InvalidSpecError("target workload: needs at least one shape")
        for shape, p in zip(self.shapes, self.probabilities, strict=True):
            if not (0.0 <= p <= 1.0) or math.isnan(p):
                raise InvalidSpecError(f"target workload: probability of {shape} must be in [0, 1], got {p}")
        total = math.fsum(self.probabilities)
        if abs(total - 1.0) > 1e-6:
            raise InvalidSpecError(f"target workload: probabilities must sum to 1, got {total}")
        if not self.share_sizes:
            shares: dict[int, float] = {}
            for shape, p in zip(self.shapes, self.probabilities, strict=True):
                if 0 < shape.gpu_milli < MILLI_PER_GPU:
                    shares[shape.gpu_milli] = shares.get(shape.gpu_milli, 0.0) + p
            object.__setattr__(self, "share_sizes", tuple(sorted(shares.items())))
        if not self.restricted_demand:
            weighted = [(s.gpu_models, p * s.gpu_milli * s.num_gpu, s.gpu_milli * s.num_gpu) for s, p in self.pairs()]
            object.__setattr__(self, "restricted_demand", _restricted(weighted))
        if not self.multi_demand:
            memories = self.memory_mib or (0,) * len(self.shapes)
            classes = [(s, p * s.num_gpu * s.gpu_milli, [m]) for (s, p), m in zip(self.pairs(), memories, strict=True)]
            object.__setattr__(self, "multi_demand", _multi(classes))

    def pairs(self) -> Iterable[tuple[WorkloadShape, float]]:
        """``(shape, probability)`` for every shape."""
        return zip(self.shapes, self.probabilities, strict=True)

    @classmethod
    def from_requests(cls, requests: Iterable[Request], coverage: float = 0.95) -> TargetWorkload:
        """FGD's definition: the most frequent shapes covering ``coverage`` of the requests, renormalised.

        Shapes are ranked by count, ties by the larger CPU, then GPU milli, card count and model spec (the
        authors' stable order); shapes are added one at a time until their count reaches ``coverage`` of all.
        CPU-only requests are shapes like any other. Each chosen shape also records its requests' median memory; the
        workload also records every share size of the requests (``share_sizes``).
        """
        if not 0.0 < coverage <= 1.0:
            raise InvalidSpecError(f"target workload: coverage must be in (0, 1], got {coverage}")
        memories: dict[WorkloadShape, list[int]] = {}
        weighted: list[tuple[frozenset[str], float, int]] = []
        for r in requests:
            memories.setdefault(WorkloadShape.of(r), []).append(r.memory_mib)
            weighted.append((r.gpu_models, float(r.total_gpu_milli), r.total_gpu_milli))
        counts = Counter({shape: len(m) for shape, m in memories.items()})
        if not counts:
            raise InvalidSpecError("target workload: no requests to learn shapes from")
        total = sum(counts.values())
        ranked = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpu, kv[0].spec),
            reverse=True,
        )
        expected = coverage * total
        chosen: list[tuple[WorkloadShape, int]] = []
        covered = 0
        for shape, n in ranked:
            if covered >= expected:
                break
            chosen.append((shape, n))
            covered += n
        shares: Counter[int] = Counter()
        for shape, n in counts.items():
            if shape.num_gpu == 1 and 0 < shape.gpu_milli < MILLI_PER_GPU:
                shares[shape.gpu_milli] += n
        multi = [(s, float(len(m) * s.num_gpu * s.gpu_milli), m) for s, m in memories.items() if s.num_gpu > 1]
        gpu_total = sum(w for _, w, _ in weighted)
        return cls(
            tuple(s for s, _ in chosen),
            tuple(n / covered for _, n in chosen),
            tuple(int(statistics.median(memories[s])) for s, _ in chosen),
            tuple((milli, n / total) for milli, n in sorted(shares.items())),
            _restricted(weighted),
            _multi(multi, gpu_total),
        )


def _restricted(
    weighted: Iterable[tuple[frozenset[str], float, int]],
) -> tuple[tuple[frozenset[str], float, float], ...]:
    """From ``(allowed models, weight of GPU demand, GPU demand of one request)``: per restricted model set its
    share of all GPU demand and ``E[X²]/E[X]`` of one request's demand, sorted by the set's spec."""
    total = 0.0
    sums: dict[frozenset[str], list[float]] = {}
    for models, weight, milli in weighted:
        total += weight
        if models and weight > 0:
            entry = sums.setdefault(models, [0.0, 0.0])
            entry[0] += weight
            entry[1] += weight * milli
    if total <= 0:
        return ()
    return tuple(
        (models, first / total, second / first)
        for models, (first, second) in sorted(sums.items(), key=lambda kv: "|".join(sorted(kv[0])))
    )


def _multi(
    classes: Iterable[tuple[WorkloadShape, float, list[int]]], total: float | None = None
) -> tuple[tuple[int, int, frozenset[str], int, float], ...]:
    """From ``(shape, weight of its GPU demand, memories of its requests)``: per multi-card class ``(cards, CPU,
    models)`` the median memory and the class's share of all GPU demand (``total``: all weights given)."""
    entries = list(classes)
    if total is None:
        total = sum(w for _, w, _ in entries)
    grouped: dict[tuple[int, int, frozenset[str]], tuple[float, list[int]]] = {}
    for shape, weight, memories in entries:
        if shape.num_gpu > 1 and weight > 0:
            key = (shape.num_gpu, shape.cpu_milli, shape.gpu_models)
            w, m = grouped.get(key, (0.0, []))
            grouped[key] = (w + weight, m + memories)
    if not total or total <= 0:
        return ()
    return tuple(
        (cards, cpu, models, int(statistics.median(m)), w / total)
        for (cards, cpu, models), (w, m) in sorted(
            grouped.items(), key=lambda kv: (kv[0][0], kv[0][1], sorted(kv[0][2]))
        )
    )


@dataclass(slots=True)
class FragmentationModel:
    """A target workload compiled for fast, cached fragmentation of node states.

    Guarantees: :meth:`fragmentation` is a pure function of its arguments (the caches never change a result),
    equal to the authors' ``NodeGpuShareFragAmountScore`` for the same node state.
    """

    workload: TargetWorkload
    _cpu_thresholds: list[int] = field(default_factory=list)
    _access: dict[str, int] = field(default_factory=dict)
    _access_masks: list[tuple[bool, ...]] = field(default_factory=list)
    _cache: dict[tuple[int, int, tuple[int, ...]], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cpu_thresholds = sorted({s.cpu_milli for s in self.workload.shapes})

    def fragmentation(self, gpu_model: str, cpu_left: int, free: Iterable[int]) -> float:
        """Expected idle milli-GPU that a task of the workload could not use, on a node in this state."""
        access = self._access.get(gpu_model)
        if access is None:
            access = self._access_class(gpu_model)
        key = (access, bisect_right(self._cpu_thresholds, cpu_left), tuple(sorted(free)))
        value = self._cache.get(key)
        if value is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            value = self._cache[key] = self._compute(self._access_masks[access], cpu_left, key[2])
        return value

    def _access_class(self, gpu_model: str) -> int:
        mask = tuple(not s.gpu_models or (bool(gpu_model) and gpu_model in s.gpu_models) for s in self.workload.shapes)
        try:
            access = self._access_masks.index(mask)
        except ValueError:
            access = len(self._access_masks)
            self._access_masks.append(mask)
        self._access[gpu_model] = access
        return access

    def _compute(self, accessible: tuple[bool, ...], cpu_left: int, free_sorted: tuple[int, ...]) -> float:
        total = sum(free_sorted)
        if total == 0:
            return 0.0
        # Fragment kinds in the authors' order: lack both, lack GPU, (satisfied), lack CPU, CPU-only ok,
        # CPU-only lacking CPU, no access. Each accumulates over shapes in order; the sum skips "satisfied".
        q1 = q2 = q4 = xl = xr = na = 0.0
        n_cards = len(free_sorted)
        for shape, p, ok in zip(self.workload.shapes, self.workload.probabilities, accessible, strict=True):
            milli = shape.gpu_milli
            cpu_fits = cpu_left >= shape.cpu_milli
            if milli == 0:
                if cpu_fits:
                    xl += p * total
                else:
                    xr += p * total
            elif not ok:
                na += p * total
            else:
                small = bisect_left(free_sorted, milli)
                if n_cards - small >= shape.num_gpu:
                    if cpu_fits:
                        q2 += p * sum(free_sorted[:small])
                    else:
                        q4 += p * total
                elif cpu_fits:
                    q2 += p * total
                else:
                    q1 += p * total
        return q1 + q2 + q4 + xl + xr + na


@cache
def compile_workload(workload: TargetWorkload) -> FragmentationModel:
    """The (shared, cached) compiled model of ``workload``."""
    return FragmentationModel(workload)


def node_fragmentation(state: ClusterState, node_index: int, workload: TargetWorkload) -> float:
    """Fragmentation of node ``node_index`` now: expected idle milli-GPU a task of ``workload`` could not use."""
    model, cpu_left, _memory, free = state.signature[node_index]
    return compile_workload(workload).fragmentation(model, cpu_left, free)


class FragmentationTracker:
    """Per-node fragmentation and the cluster total, kept current incrementally.

    Call :meth:`update` with each node that changed (or :meth:`refresh` after many changes); the total is then
    exact up to float rounding, which a periodic full re-sum bounds.
    """

    _RESUM_EVERY = 4096

    def __init__(self, state: ClusterState, workload: TargetWorkload) -> None:
        self.state = state
        self.workload = workload
        self.model = compile_workload(workload)
        self._signature = list(state.signature)
        self.per_node: list[float] = [self._of(i) for i in range(len(state))]
        self.total: float = math.fsum(self.per_node)
        self._updates = 0

    def update(self, node_index: int) -> float:
        """Re-evaluate one node (cheap when its signature did not change); returns the new cluster total."""
        sig = self.state.signature[node_index]
        if sig is self._signature[node_index] or sig == self._signature[node_index]:
            return self.total
        self._signature[node_index] = sig
        value = self._of(node_index)
        self.total += value - self.per_node[node_index]
        self.per_node[node_index] = value
        self._updates += 1
        if self._updates % self._RESUM_EVERY == 0:
            self.total = math.fsum(self.per_node)
        return self.total

    def refresh(self) -> float:
        """Re-evaluate every node whose signature changed."""
        for i in range(len(self.state)):
            self.update(i)
        self.total = math.fsum(self.per_node)
        return self.total

    def idle_gpu_milli(self) -> int:
        """Free milli-GPU on usable cards of the whole cluster."""
        return sum(sum(sig.free_gpu) for sig in self.state.signature)

    def rate(self) -> float:
        """Fragmentation as a share of idle GPU (0..1; 0 when nothing is idle)."""
        idle = self.idle_gpu_milli()
        return self.total / idle if idle else 0.0

    def _of(self, i: int) -> float:
        model, cpu_left, _memory, free = self.state.signature[i]
        return self.model.fragmentation(model, cpu_left, free)
