"""Per-pod measurements of one replay, and the published way of turning them into curves.

A replay records one row per arrived pod (placed or not) in O(1): arrived milli-GPU so far, allocated
milli-GPU, the cluster's fragmentation amount and the time the decision took. Curves and summaries are
computed once, at the end.

The FGD authors sample their curves at each integer *arrived %* (arrived GPU request as a percentage of
cluster capacity, 0..130) like this (``experiments/analysis/merge_alloc_discrete.py`` in
hkust-adsl/kubernetes-scheduler-simulator): every row gets ``arrive = round(arrived / total_gpus / 10)`` and
``alloc = round(used / total_gpus / 10, 2)`` (both in %); the value at ``a`` is the mean ``alloc`` of the rows
with ``arrive == a``, or, when there is none, of the rows with ``a - 1 <= arrive <= a + 1``; no row at all
leaves a gap. The fragmentation curve is ``100 * mean(frag milli) / 1000 / total_gpus`` over the same rows.
:func:`sample_curve` does exactly that.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU

ARRIVED_PERCENTS: tuple[int, ...] = tuple(range(131))
"""The arrived-% points of a published curve: 0, 1, ..., 130."""

Curve = list[float | None]
"""One value per point of :data:`ARRIVED_PERCENTS`; ``None`` where no pod arrived near that point."""


def shape_key(request: Request) -> str:
    """A short, stable name for a request's shape, for counting failures: ``1x460``, ``2x1000@V100M32``, ``cpu``."""
    base = f"{request.num_gpu}x{request.gpu_milli}" if request.num_gpu else "cpu"
    if request.gpu_models:
        return f"{base}@{'|'.join(sorted(request.gpu_models))}"
    return base


class RunRecorder:
    """Collects one row per arrived pod; every :meth:`record` is O(1).

    ``capacity_milli`` is the cluster's GPU capacity; percentages are relative to it.
    """

    def __init__(self, capacity_milli: int) -> None:
        if capacity_milli <= 0:
            raise ValueError(f"capacity_milli must be > 0, got {capacity_milli}")
        self.capacity_milli = capacity_milli
        self.arrived_milli = array("q")
        self.allocated_milli = array("q")
        self.frag_milli = array("d")
        self.decision_seconds = array("d")
        self.failed_by_shape: Counter[str] = Counter()
        self._arrived = 0
        self.placed = 0
        self.failed = 0

    def record(self, request: Request, placed: bool, allocated_milli: int, frag_milli: float, seconds: float) -> None:
        """Add the row for ``request`` right after its decision (``allocated_milli`` is the cluster total)."""
        self._arrived += request.total_gpu_milli
        self.arrived_milli.append(self._arrived)
        self.allocated_milli.append(allocated_milli)
        self.frag_milli.append(frag_milli)
        self.decision_seconds.append(seconds)
        if placed:
            self.placed += 1
        else:
            self.failed += 1
            self.failed_by_shape[shape_key(request)] += 1

    def __len__(self) -> int:
        return len(self.arrived_milli)

    # ---- results ---------------------------------------------------------------------------------------

    @property
    def total_gpus(self) -> int:
        """Cluster capacity in whole cards (the published files' ``total_gpus``)."""
        return self.capacity_milli // MILLI_PER_GPU

    def alloc_curve(self) -> Curve:
        """Allocation ratio (%) at each arrived % (the published ``alloc.csv`` row)."""
        return sample_curve(self.arrived_milli, self.allocated_milli, self.capacity_milli)

    def frag_curve(self) -> Curve:
        """Fragmentation amount as % of capacity at each arrived % (the published ``frag.csv`` row)."""
        return sample_curve(self.arrived_milli, self.frag_milli, self.capacity_milli, round_rows=False)

    def final_frag_rate(self) -> float:
        """Fragmentation amount / idle milli-GPU after the last pod, in % (the FGD paper's fragmentation rate)."""
        if not self.frag_milli:
            return 0.0
        idle = self.capacity_milli - self.allocated_milli[-1]
        return 100.0 * self.frag_milli[-1] / idle if idle > 0 else 0.0

    def decision_stats(self) -> DecisionStats:
        return DecisionStats.of(self.decision_seconds)


@dataclass(frozen=True, slots=True)
class DecisionStats:
    """How long the scheduler took per decision."""

    decisions: int
    total_seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def per_second(self) -> float:
        return self.decisions / self.total_seconds if self.total_seconds > 0 else 0.0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> DecisionStats:
        if not seconds:
            return cls(0, 0.0, 0.0, 0.0)
        arr = _as_float_array(seconds)
        p50, p99 = np.percentile(arr, [50, 99])
        return cls(len(arr), float(arr.sum()), float(p50) * 1e3, float(p99) * 1e3)


def sample_curve(
    arrived_milli: Sequence[int],
    values_milli: Sequence[float],
    capacity_milli: int,
    *,
    round_rows: bool = True,
    points: Sequence[int] = ARRIVED_PERCENTS,
) -> Curve:
    """Sample per-pod ``values_milli`` at each integer arrived % of ``capacity_milli``, as the FGD authors do.

    Each row's arrived % is rounded to an integer (half to even); the value at point ``a`` is the mean of the
    rows at ``a`` (else at ``a - 1 .. a + 1``), as a % of capacity rounded to 2 decimals. ``round_rows`` rounds
    each row's % to 2 decimals before averaging (the published allocation curve does; fragmentation does not).
    """
    if len(arrived_milli) != len(values_milli):
        raise ValueError(f"{len(arrived_milli)} arrived values but {len(values_milli)} measurements")
    if not points:
        return []
    arrived = _as_float_array(arrived_milli)
    values = _as_float_array(values_milli)
    # capacity_milli / 1000 / 10 == total_gpus * 10: divide in the published order to round identically.
    total_gpus = capacity_milli / MILLI_PER_GPU
    arrive_pct = np.round(arrived / total_gpus / 10).astype(np.int64)
    value_pct = values / total_gpus / 10
    if round_rows:
        value_pct = np.round(value_pct, 2)
    top = max(points) + 2
    in_range = (arrive_pct >= 0) & (arrive_pct < top)
    buckets = arrive_pct[in_range]
    sums = np.bincount(buckets, weights=value_pct[in_range], minlength=top)
    counts = np.bincount(buckets, minlength=top)
    curve: Curve = []
    for a in points:
        lo, hi = max(a - 1, 0), a + 1
        if counts[a]:
            total, n = float(sums[a]), int(counts[a])
        else:
            total, n = float(sums[lo : hi + 1].sum()), int(counts[lo : hi + 1].sum())
        curve.append(round(total / n, 2) if n else None)
    return curve


def value_at(curve: Sequence[float | None], arrived_percent: int) -> float | None:
    """The curve's value at an integer arrived % (``None`` where it has a gap)."""
    if not 0 <= arrived_percent < len(curve):
        return None
    return curve[arrived_percent]


def _as_float_array(values: Sequence[float]) -> npt.NDArray[np.float64]:
    if isinstance(values, array):
        return np.asarray(values, dtype=np.float64)
    return np.asarray(list(values), dtype=np.float64)
