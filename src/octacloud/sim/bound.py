"""A lower bound on the unallocated GPU share at 100 % arrived: an LP relaxation of the packing, solved by HiGHS.

For one run's pod sequence (shuffled and inflated as the protocol does), take the pods that have arrived when the
arrived GPU request reaches :data:`ARRIVED_LIMIT` of capacity (the last row that the curve's 100 % point can
average: rows round ``arrived / capacity`` to whole percent). No policy can allocate more GPU at any of those rows
than the most GPU that any subset of those pods can take on the empty fleet, so
``100 − 100 · max allocated / capacity`` bounds every policy's unallocated % at 100 % from below.

The maximum is relaxed to a linear programme over classes: pods grouped by ``(CPU, memory, cards, milli-GPU per
card, allowed models)``, nodes by ``(model, cards, CPU, memory)``. ``x[c, t] ≥ 0`` pods of class ``c`` go to node
class ``t``, only where one such pod fits an empty node of ``t``. Maximise the GPU placed subject to: at most the
class's count per pod class; per node class, the summed CPU, memory and milli-GPU within its nodes' totals, and
*cards*, once per dual feasible function ``u_k`` (Fekete and Schepers): a whole-card pod counts ``num_gpu``
cards, a share of ``x`` of a card counts ``u_k(x) = x`` where ``(k + 1)·x`` is whole and ``⌊(k + 1)·x⌋ / k``
otherwise, for ``k = 1 …`` :data:`DFF_ORDERS`, at most the class's cards. (Shares on one card sum to at most 1,
so their ``u_k`` do too: ``k = 1`` says two shares above half a card never share one; ``k = 4`` counts an 810
as a whole card, since what it leaves takes only shares below 200, which count 0.) CPU-only pods are left out
(they take no GPU and leaving them out only loosens the bound). Every integral placement satisfies these
constraints, so the LP optimum is an upper bound on allocation; what the LP ignores (which shares pair on a card
beyond the ``u_k`` rows, the node boundaries of CPU and memory within a class, arrival order, the online rule
that a failed pod stays failed) is what the gap between a policy and the bound may contain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node, Request
from octacloud.core.units import MILLI_PER_GPU

ARRIVED_LIMIT = 1.005
"""Arrived GPU request, as a fraction of capacity, up to which pods count (the curve's 100 % point averages the
rows that round to 100 %, i.e. below 100.5 %)."""


DFF_ORDERS = 10
"""Card rows per node class: one per dual feasible function ``u_1 … u_10``."""


def dff(k: int, milli: int) -> float:
    """``u_k`` of a share of ``milli`` milli-GPU, in cards (exact in integer arithmetic)."""
    scaled = (k + 1) * milli
    if scaled % MILLI_PER_GPU == 0:
        return milli / MILLI_PER_GPU
    return (scaled // MILLI_PER_GPU) / k


@dataclass(frozen=True, slots=True)
class PackingBound:
    """The relaxation's outcome for one pod sequence."""

    unallocated_pct: float
    """Lower bound on unallocated GPU % at 100 % arrived."""
    allocated_milli: float
    capacity_milli: int
    arrived_milli: int
    pod_classes: int
    node_classes: int


def arrived_prefix(requests: Sequence[Request], capacity_milli: int, limit: float = ARRIVED_LIMIT) -> list[Request]:
    """The requests that have arrived while the arrived GPU request stays below ``limit`` × capacity."""
    out: list[Request] = []
    arrived = 0
    for r in requests:
        if arrived + r.total_gpu_milli >= limit * capacity_milli:
            break
        arrived += r.total_gpu_milli
        out.append(r)
    return out


PodClass = tuple[int, int, int, int, frozenset[str]]
"""``(CPU milli, memory MiB, cards, milli-GPU per card, allowed models)``: pods the relaxation does not tell apart."""


def pod_class(request: Request) -> PodClass:
    return (request.cpu_milli, request.memory_mib, request.num_gpu, request.gpu_milli, request.gpu_models)


def packing_bound(nodes: Sequence[Node], requests: Sequence[Request]) -> PackingBound:
    """The LP bound for ``requests`` (already the arrived prefix) on the empty fleet ``nodes``."""
    capacity = sum(n.gpu_milli for n in nodes)
    if capacity <= 0:
        raise InvalidSpecError("packing bound: the fleet has no GPUs")
    pods = Counter(pod_class(r) for r in requests if r.total_gpu_milli)
    arrived = sum(r.total_gpu_milli for r in requests)
    allocated = min(_max_allocated(nodes, dict(pods)), float(capacity), float(arrived))
    kinds = {(n.gpu_model, n.gpu_count, n.cpu_milli, n.memory_mib) for n in nodes if n.gpu_count}
    return PackingBound(
        round(100.0 - 100.0 * allocated / capacity, 4), allocated, capacity, arrived, len(pods), len(kinds)
    )


@dataclass(frozen=True, slots=True)
class ChurnBound:
    """Upper bounds on the time-averaged allocated GPU % of a churn workload in steady state (any policy)."""

    offered_pct: float
    """Mean GPU demand of the running work if every request started at once (Little's law), % of capacity."""
    any_pct: float
    """The most any discipline can allocate on time average, whatever classes it leaves waiting."""
    proportional_pct: float
    """The most it can allocate while serving every class the same fraction of its arrivals (none starved more
    than another)."""
    served_fraction: float
    """That fraction (1: the whole offered load fits)."""


def churn_bound(nodes: Sequence[Node], shapes: Sequence[Request], rate: float, mean_lifetime: float) -> ChurnBound:
    """The LP of :func:`packing_bound` over the steady state of churn: requests drawn uniformly from ``shapes``
    arrive at ``rate`` per second and run ``mean_lifetime`` seconds on average once started.

    By Little's law the time-averaged number of class-``c`` requests running is at most its arrival rate times the
    mean lifetime (a class cannot run more than arrives, whatever waits or moves); the time average of the running
    sets is a convex combination of feasible packings, so it satisfies every constraint of the relaxation. The LP
    with those means as class counts therefore bounds the time-averaged allocation of every policy, queue
    discipline and defragmentation (up to the sampling noise of a finite run). With ``proportional``, each class
    that fits some node is served the same fraction ``s`` of its arrivals, maximised.
    """
    capacity = sum(n.gpu_milli for n in nodes)
    if capacity <= 0 or not shapes or rate <= 0 or mean_lifetime <= 0:
        raise InvalidSpecError("churn bound: need a fleet with GPUs, shapes, rate > 0 and mean lifetime > 0")
    per_shape = rate * mean_lifetime / len(shapes)
    counts: Counter[PodClass] = Counter()
    for r in shapes:
        if r.total_gpu_milli:
            counts[pod_class(r)] += 1
    pods = {c: n * per_shape for c, n in counts.items()}
    demand = sum(n * c[2] * c[3] for c, n in pods.items())
    free = min(_max_allocated(nodes, pods), float(capacity), demand)
    fraction = _max_allocated(nodes, pods, proportional=True)
    return ChurnBound(
        round(100.0 * demand / capacity, 4),
        round(100.0 * free / capacity, 4),
        round(100.0 * min(fraction * demand, free) / capacity, 4),
        round(min(fraction, 1.0), 6),
    )


def _max_allocated(nodes: Sequence[Node], pods: dict[PodClass, float], *, proportional: bool = False) -> float:
    """The LP optimum: milli-GPU placed (or, with ``proportional``, the fraction ``s`` of every class placed)."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    kinds = Counter((n.gpu_model, n.gpu_count, n.cpu_milli, n.memory_mib) for n in nodes if n.gpu_count)
    pod_list, kind_list = list(pods.items()), list(kinds.items())
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    gain: list[float] = []
    variables = 0
    pod_row0 = 0
    per_kind = 3 + DFF_ORDERS  # rows per node kind: CPU, memory, milli-GPU, then cards under each u_k
    kind_row0 = len(pod_list)
    placeable: set[int] = set()
    for c, ((cpu, memory, num, milli, models), _count) in enumerate(pod_list):
        for t, ((model, cards, node_cpu, node_memory), _n) in enumerate(kind_list):
            if num > cards or cpu > node_cpu or memory > node_memory or (models and model not in models):
                continue
            placeable.add(c)
            base = kind_row0 + per_kind * t
            cards_used = [float(num) if milli >= MILLI_PER_GPU else dff(k, milli) for k in range(1, DFF_ORDERS + 1)]
            for row, value in (
                (pod_row0 + c, 1.0),
                (base, float(cpu)),
                (base + 1, float(memory)),
                (base + 2, float(num * milli)),
                *((base + 2 + k, used) for k, used in enumerate(cards_used, start=1)),
            ):
                if value:
                    rows.append(row)
                    cols.append(variables)
                    vals.append(value)
            gain.append(0.0 if proportional else float(num * milli))
            variables += 1
    bounds = [float(n) for _, n in pod_list]
    for (_model, cards, node_cpu, node_memory), n in kind_list:
        bounds += [float(n * node_cpu), float(n * node_memory), float(n * cards * MILLI_PER_GPU)]
        bounds += [float(n * cards)] * DFF_ORDERS
    if variables == 0:
        return 0.0
    if proportional:
        counts = [float(n) for _, n in pod_list]
        result = _solve_proportional(rows, cols, vals, bounds, kind_row0, sorted(placeable), counts, variables)
    else:
        matrix = coo_matrix((vals, (rows, cols)), shape=(len(bounds), variables)).tocsr()
        result = linprog(-np.asarray(gain), A_ub=matrix, b_ub=np.asarray(bounds), bounds=(0, None), method="highs")
    if result.status != 0:
        raise InvalidSpecError(f"packing bound: the LP solver failed ({result.message})")
    return float(-result.fun)


def _solve_proportional(
    rows: list[int],
    cols: list[int],
    vals: list[float],
    bounds: list[float],
    kind_row0: int,
    keep: list[int],
    counts: list[float],
    variables: int,
) -> Any:
    """The proportional LP: the largest ``s`` such that every placeable class (``keep``) places exactly ``s`` × its
    count (``counts``) within the node kinds' rows (those from ``kind_row0`` on); its result as ``linprog``'s."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    # one more variable s: every placeable class places exactly s × its count (its row becomes an equality)
    index = {c: j for j, c in enumerate(keep)}
    pairs = [(index[r], col) for r, col in zip(rows, cols, strict=True) if r < kind_row0]
    eq = coo_matrix(
        (
            [1.0] * len(pairs) + [-counts[c] for c in keep],
            ([j for j, _ in pairs] + list(range(len(keep))), [col for _, col in pairs] + [variables] * len(keep)),
        ),
        shape=(len(keep), variables + 1),
    ).tocsr()
    ub = coo_matrix(
        (
            [v for v, r in zip(vals, rows, strict=True) if r >= kind_row0],
            (
                [r - kind_row0 for r in rows if r >= kind_row0],
                [c for c, r in zip(cols, rows, strict=True) if r >= kind_row0],
            ),
        ),
        shape=(len(bounds) - kind_row0, variables + 1),
    ).tocsr()
    cost = np.zeros(variables + 1)
    cost[variables] = -1.0
    return linprog(
        cost,
        A_ub=ub,
        b_ub=np.asarray(bounds[kind_row0:]),
        A_eq=eq,
        b_eq=np.zeros(len(keep)),
        bounds=(0, None),
        method="highs",
    )
