"""The re-evaluation loop: every ``period`` seconds, re-evaluate the whole cluster (pure; no I/O, no asyncio).

One pass over a :class:`ClusterState` (through its :class:`Scheduler`) and the pending requests:

1. **place**: pending requests in order of priority (highest first), then arrival (the caller's order);
2. **preempt**: a request still unplaced that outranks running work may evict the cheapest lower-priority set
   on one node (:func:`octacloud.scheduler.actions.preempt.preempt`); the victims join the pending list;
3. **defragment**: a request still unplaced may move running replicas elsewhere
   (:func:`octacloud.scheduler.actions.defragment.defragment`), within a budget of moves per pass.

Within a pass, a request shape that failed a step is not retried at that step (fit is monotone while the pass
only fills the cluster), which keeps a long queue of few shapes cheap. The caller owns the queue and the clock:
the cloud's controller and the simulator's churn mode call :meth:`ReevaluationLoop.due` and :meth:`run_pass`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Placement, Request
from octacloud.scheduler.actions.defragment import DEFAULT_MAX_MOVES, Move, defragment
from octacloud.scheduler.actions.preempt import preempt
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import Allocation

DEFAULT_PERIOD = 5.0
"""Seconds between passes (the design's loop)."""
DEFAULT_MOVES_PER_PASS = 16
DEFAULT_DEFRAG_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class LoopSettings:
    period: float = DEFAULT_PERIOD
    preempt: bool = True
    defragment: bool = True
    moves_per_pass: int = DEFAULT_MOVES_PER_PASS
    """Budget of replica moves in one pass (all defragmentations together)."""
    moves_per_request: int = DEFAULT_MAX_MOVES
    defrag_attempts: int = DEFAULT_DEFRAG_ATTEMPTS
    """Pending requests (of distinct shapes) defragmentation may try per pass: bounds a pass's cost."""
    allow_pinned: bool = False
    """Whether preemption and defragmentation may touch pinned work."""

    def __post_init__(self) -> None:
        if not self.period > 0:
            raise InvalidSpecError(f"loop: period must be > 0 seconds, got {self.period}")
        if self.defrag_attempts < 0:
            raise InvalidSpecError(f"loop: defrag_attempts must be >= 0, got {self.defrag_attempts}")
        if self.moves_per_pass < 0 or self.moves_per_request < 0:
            raise InvalidSpecError(
                f"loop: move budgets must be >= 0, got {self.moves_per_pass} per pass, {self.moves_per_request} each"
            )


@dataclass(frozen=True, slots=True)
class Start:
    """Start ``request`` on ``placement``; its room is free only once every replica named in ``after`` left."""

    request: Request
    placement: Placement
    after: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Evict:
    """Stop running ``victim`` (preempted by ``by``): it holds nothing in the state any more and is pending again."""

    victim: Allocation
    by: str


PassOperation = Evict | Move | Start
"""What a pass asks its caller to carry out."""


@dataclass(slots=True)
class PassReport:
    """What one pass did. ``placed`` maps a pending request's name to its placement."""

    started: float
    placed: dict[str, Placement] = field(default_factory=dict)
    preempted: list[Allocation] = field(default_factory=list)
    """Victims evicted by preemption (released; the caller re-queues them, they are also in ``pending``)."""
    moves: list[Move] = field(default_factory=list)
    pending: list[Request] = field(default_factory=list)
    """Still unplaced after the pass, in priority order (victims included)."""
    seconds: float = 0.0
    """Wall time the pass took (measured with the injected timer)."""
    operations: list[PassOperation] = field(default_factory=list)
    """What the caller carries out, in order (see the module's docstring)."""


def _shape(r: Request) -> tuple[object, ...]:
    return (r.num_gpu, r.gpu_milli, r.gpu_memory_mib, r.cpu_milli, r.memory_mib, r.gpu_models, r.priority, r.failover)


class ReevaluationLoop:
    """Decides when a pass is due on an injected clock, and runs passes over one scheduler's cluster."""

    def __init__(
        self,
        scheduler: Scheduler,
        settings: LoopSettings | None = None,
        *,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.scheduler = scheduler
        self.settings = settings or LoopSettings()
        self._timer = timer
        self._next: float | None = None
        self.passes = 0
        self.total_moves = 0

    def due(self, now: float) -> bool:
        """True when a pass should run at ``now`` (the first call is always due)."""
        return self._next is None or now >= self._next

    def run_pass(self, now: float, pending: Sequence[Request]) -> PassReport:
        """Re-evaluate the cluster at time ``now`` with ``pending`` waiting; schedules the next pass."""
        started = self._timer()
        s = self.settings
        report = PassReport(now)
        queue = sorted(pending, key=lambda r: -r.priority)  # stable: arrival order within a priority
        failed: set[tuple[object, ...]] = set()
        waiting: list[Request] = []
        for r in queue:
            if _shape(r) in failed:
                waiting.append(r)
                continue
            decision = self.scheduler.schedule(r)
            if decision.placement is None:
                failed.add(_shape(r))
                waiting.append(r)
            else:
                report.placed[r.name] = decision.placement
                report.operations.append(Start(decision.request, decision.placement))
        if s.preempt and waiting:
            waiting = self._preempt(waiting, report)
        if s.defragment and waiting and s.moves_per_pass > 0:
            waiting = self._defragment(waiting, report)
        report.pending = waiting
        report.seconds = self._timer() - started
        self.passes += 1
        self.total_moves += len(report.moves)
        self._next = now + s.period
        return report

    def _preempt(self, waiting: list[Request], report: PassReport) -> list[Request]:
        lowest = min((a.request.priority for a in self.scheduler.state), default=None)
        still: list[Request] = []
        victims: list[Request] = []
        failed: set[tuple[object, ...]] = set()
        for r in waiting:
            if lowest is None or r.priority <= lowest or _shape(r) in failed:
                still.append(r)
                continue
            outcome = preempt(self.scheduler, r, allow_pinned=self.settings.allow_pinned)
            if outcome is None:
                failed.add(_shape(r))
                still.append(r)
                continue
            report.placed[r.name] = outcome.placement
            report.preempted.extend(outcome.victims)
            report.operations.extend(Evict(v, r.name) for v in outcome.victims)
            after = tuple(v.request.name for v in outcome.victims)
            report.operations.append(Start(outcome.request, outcome.placement, after))
            victims.extend(v.request for v in outcome.victims)
        return sorted([*still, *victims], key=lambda r: -r.priority)

    def _defragment(self, waiting: list[Request], report: PassReport) -> list[Request]:
        s = self.settings
        budget, attempts = s.moves_per_pass, s.defrag_attempts
        still: list[Request] = []
        failed: set[tuple[object, ...]] = set()
        for r in waiting:
            if budget <= 0 or attempts <= 0 or _shape(r) in failed:
                still.append(r)
                continue
            attempts -= 1
            outcome = defragment(
                self.scheduler, r, max_moves=min(budget, s.moves_per_request), allow_pinned=s.allow_pinned
            )
            if outcome is None:
                failed.add(_shape(r))
                still.append(r)
                continue
            report.placed[r.name] = outcome.placement
            report.moves.extend(outcome.moves)
            report.operations.extend(outcome.moves)
            after = tuple(m.request.name for m in outcome.moves)
            report.operations.append(Start(outcome.request, outcome.placement, after))
            budget -= len(outcome.moves)
        return still
