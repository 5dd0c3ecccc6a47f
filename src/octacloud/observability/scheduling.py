"""What the controller's scheduling did: decisions by outcome, their latency, preemptions, defragmentation moves.

The controller calls :meth:`SchedulingStats.decision` once per placement attempt and the other hooks as things
happen; the cloud's exporter reads the counters at scrape time. Updates happen on the controller's event loop
only, so plain integers suffice (a scrape from another thread reads a value at most one update old).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

DECISION_BUCKETS_S: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
"""Upper bounds (seconds) of the decision-latency histogram; ``+Inf`` is implied."""


class Outcome(enum.Enum):
    """How a placement attempt ended."""

    PLACED = "placed"  # the scheduler found room
    PREEMPTED = "preempted"  # placed after evicting lower-priority replicas
    UNSCHEDULABLE = "unschedulable"  # fits nowhere, stays pending


@dataclass(slots=True)
class SchedulingStats:
    """Cumulative counters of the controller's scheduling. Counts never decrease."""

    decisions: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(DECISION_BUCKETS_S) + 1))
    """Non-cumulative counts per bucket; the last one is ``+Inf``."""
    latency_sum_s: float = 0.0
    preemptions: int = 0
    """Replicas evicted to make room for higher-priority ones."""
    defragmentation_moves: int = 0
    """Replicas moved to another slice to consolidate free octants."""

    def decision(self, outcome: Outcome, seconds: float) -> None:
        """Record one placement attempt that took ``seconds`` (scheduler plus preemption search)."""
        self.decisions[outcome] += 1
        self.bucket_counts[bisect.bisect_left(DECISION_BUCKETS_S, seconds)] += 1
        self.latency_sum_s += seconds

    def preempted(self, victims: int) -> None:
        self.preemptions += victims

    def moved(self, replicas: int = 1) -> None:
        self.defragmentation_moves += replicas

    @property
    def decision_count(self) -> int:
        return sum(self.decisions.values())

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as a Prometheus histogram writes them, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*(repr(b) for b in DECISION_BUCKETS_S), "+Inf"), self.bucket_counts, strict=True):
            running += n
            out.append((bound, running))
        return out
