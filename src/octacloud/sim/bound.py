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


def packing_bound(nodes: Sequence[Node], requests: Sequence[Request]) -> PackingBound:
    """The LP bound for ``requests`` (already the arrived prefix) on the empty fleet ``nodes``."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    capacity = sum(n.gpu_milli for n in nodes)
    if capacity <= 0:
        raise InvalidSpecError("packing bound: the fleet has no GPUs")
    pods = Counter(
        (r.cpu_milli, r.memory_mib, r.num_gpu, r.gpu_milli, r.gpu_models) for r in requests if r.total_gpu_milli
    )
    kinds = Counter((n.gpu_model, n.gpu_count, n.cpu_milli, n.memory_mib) for n in nodes if n.gpu_count)
    pod_list, kind_list = list(pods.items()), list(kinds.items())
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    bounds: list[float] = []
    gain: list[float] = []
    variables = 0
    pod_row0 = 0
    per_kind = 3 + DFF_ORDERS  # rows per node kind: CPU, memory, milli-GPU, then cards under each u_k
    kind_row0 = len(pod_list)
    for c, ((cpu, memory, num, milli, models), _count) in enumerate(pod_list):
        for t, ((model, cards, node_cpu, node_memory), _n) in enumerate(kind_list):
            if num > cards or cpu > node_cpu or memory > node_memory or (models and model not in models):
                continue
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
            gain.append(float(num * milli))
            variables += 1
    bounds = [float(n) for _, n in pod_list]
    for (_model, cards, node_cpu, node_memory), n in kind_list:
        bounds += [float(n * node_cpu), float(n * node_memory), float(n * cards * MILLI_PER_GPU)]
        bounds += [float(n * cards)] * DFF_ORDERS
    arrived = sum(r.total_gpu_milli for r in requests)
    if variables == 0:
        allocated = 0.0
    else:
        matrix = coo_matrix((vals, (rows, cols)), shape=(len(bounds), variables)).tocsr()
        result = linprog(-np.asarray(gain), A_ub=matrix, b_ub=np.asarray(bounds), bounds=(0, None), method="highs")
        if result.status != 0:
            raise InvalidSpecError(f"packing bound: the LP solver failed ({result.message})")
        allocated = float(-result.fun)
    allocated = min(allocated, float(capacity), float(arrived))
    return PackingBound(
        round(100.0 - 100.0 * allocated / capacity, 4), allocated, capacity, arrived, len(pod_list), len(kind_list)
    )
