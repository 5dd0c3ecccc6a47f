"""Churn mode: arrivals and departures on simulated time, with a periodic re-evaluation loop.

An event queue (a heap ordered by time, then kind, then sequence) drives a :class:`ChurnSimulation` over an
injected :class:`~octacloud.core.clock.ManualClock`. At equal times departures go first (they free capacity),
then re-evaluation ticks, then arrivals. Nothing reads the wall clock except the decision timer.

* An arrival is placed at once when it fits (through ``admission`` when given: the re-evaluation loop's
  :meth:`~octacloud.scheduler.loop.ReevaluationLoop.admit`, which keeps the queue's reservations). Otherwise it
  fails for good, or, with ``queue=True``, waits in :attr:`ChurnSimulation.pending` (FIFO) for a re-evaluation
  to place it.
* A placed request departs ``lifetime`` seconds after it started; with ``on_release`` given (the loop's
  :meth:`~octacloud.sim.reevaluate.LoopHook.released`), the capacity it frees is offered to the queue at once.
  Departures are keyed by request name (not by node), so a re-evaluation may *move* running work
  (defragmentation) through a :class:`~octacloud.scheduler.framework.Transaction` without telling the loop;
  :meth:`ChurnSimulation.evict` stops running work and re-queues it with the lifetime it has left (preemption).
* Every ``period`` seconds (5 by default, the design's loop) the :class:`ReevaluationHook`\\ s run in order.
  With ``queue=True`` and no hooks given, the loop retries the pending queue (:func:`retry_pending`).

Time-averaged GPU allocation integrates ``ClusterState.allocated_gpu_milli`` exactly: it only changes at
events, and the loop accrues the area of every interval between two events.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from octacloud.core.clock import ManualClock
from octacloud.core.model import Request
from octacloud.scheduler.framework import Decision, Scheduler
from octacloud.sim.synthetic import Arrival


class EventKind(enum.IntEnum):
    """Order of events at the same instant: free capacity, then re-evaluate, then admit new work."""

    DEPARTURE = 0
    TICK = 1
    ARRIVAL = 2


@dataclass(slots=True)
class Pending:
    """A request waiting to be placed, and how much longer it will run once placed."""

    request: Request
    lifetime: float
    since: float


@dataclass(frozen=True, slots=True)
class Running:
    request: Request
    started: float
    departs: float
    epoch: int
    """Distinguishes this run from an earlier one of the same request (evicted and placed again)."""


class ReevaluationHook(Protocol):
    """Runs every ``period`` seconds of simulated time with the whole simulation at hand.

    A hook may place pending requests (:meth:`ChurnSimulation.try_place`, :meth:`ChurnSimulation.take_pending`),
    move running requests through a :class:`~octacloud.scheduler.framework.Transaction` on
    ``sim.scheduler.state`` (moves keep each request's name, so its departure still applies), and evict
    (:meth:`ChurnSimulation.evict`). It must leave the state consistent: every running request allocated
    exactly once, and never read the wall clock (``sim.clock`` is the time).
    """

    def __call__(self, sim: ChurnSimulation) -> None: ...


def retry_pending(sim: ChurnSimulation) -> None:
    """The plain re-evaluation: try every pending request once, oldest first; those that fit start now.

    Within one pass the cluster only fills up, so once a request shape has failed every later request of the
    same shape would fail too: it is skipped (fit is monotone in free capacity), which keeps a long queue of a
    few shapes cheap without changing any outcome.
    """
    failed: set[tuple[object, ...]] = set()
    waiting: list[Pending] = []
    for item in sim.take_pending():
        r = item.request
        shape = (
            r.num_gpu,
            r.gpu_milli,
            r.gpu_memory_mib,
            r.cpu_milli,
            r.memory_mib,
            r.gpu_models,
            r.priority,
            r.failover,
        )
        if shape in failed or not sim.try_place(r, item.lifetime, since=item.since):
            failed.add(shape)
            waiting.append(item)
    sim.pending.extend(waiting)


WAIT_CLASSES = ("share", "one card", "multi-card", "cpu only")
"""How waits are reported: by the kind of request (a share of a card, one whole card, several cards, no GPU)."""


def wait_class(request: Request) -> str:
    """The :data:`WAIT_CLASSES` entry of ``request``."""
    if request.num_gpu == 0:
        return "cpu only"
    if request.num_gpu > 1:
        return "multi-card"
    return "share" if request.is_sharing else "one card"


@dataclass(frozen=True, slots=True)
class WaitStats:
    """Waits of one request class that arrived inside the measured window (seconds)."""

    started: int
    mean: float
    p95: float
    max: float
    queued_at_end: int
    """Arrived in the window and still waiting at the end (starvation shows here, not in the waits)."""
    longest_queued: float
    """Longest wait so far of those still queued at the end."""
    mean_with_queued: float
    """Mean wait of every request of the class that arrived in the window, one still queued counted at its wait so
    far. The waits of started requests alone favour a policy that leaves its longest waiters queued (they never
    enter the figure); this one counts them, as a lower bound of what they will wait."""
    p95_with_queued: float
    """The 95th percentile of the same (nearest rank)."""

    def as_dict(self) -> dict[str, object]:
        return {
            "started": self.started,
            "mean_wait_seconds": round(self.mean, 3),
            "p95_wait_seconds": round(self.p95, 3),
            "max_wait_seconds": round(self.max, 3),
            "queued_at_end": self.queued_at_end,
            "longest_queued_seconds": round(self.longest_queued, 3),
            "mean_wait_with_queued_seconds": round(self.mean_with_queued, 3),
            "p95_wait_with_queued_seconds": round(self.p95_with_queued, 3),
        }


def _p95(ordered: Sequence[float]) -> float:
    """Nearest-rank 95th percentile of an ascending sequence (0 when empty)."""
    return ordered[min(len(ordered) - 1, max(0, -(-95 * len(ordered) // 100) - 1))] if ordered else 0.0


def _wait_stats(waits: Sequence[float], queued: Sequence[float]) -> WaitStats:
    ordered = sorted(waits)
    every = sorted((*waits, *queued))
    return WaitStats(
        len(ordered),
        sum(ordered) / len(ordered) if ordered else 0.0,
        _p95(ordered),
        ordered[-1] if ordered else 0.0,
        len(queued),
        max(queued, default=0.0),
        sum(every) / len(every) if every else 0.0,
        _p95(every),
    )


@dataclass(frozen=True, slots=True)
class ChurnReport:
    """What a churn run measured over ``[warmup, until]`` of simulated time."""

    until: float
    warmup: float
    arrivals: int
    placed: int
    failed: int
    """Arrivals that fit nowhere and were dropped (without a queue)."""
    completed: int
    queued_at_end: int
    max_queue: int
    mean_wait_seconds: float
    """Mean time from arrival to start over placed requests (0 without a queue)."""
    time_avg_allocated_pct: float
    final_allocated_pct: float
    reevaluations: int
    decisions: int
    decision_seconds: float
    waits: dict[str, WaitStats] = field(default_factory=dict)
    """Per :data:`WAIT_CLASSES` entry: waits of the requests that arrived inside the window."""

    @property
    def decisions_per_second(self) -> float:
        return self.decisions / self.decision_seconds if self.decision_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "until": self.until,
            "warmup": self.warmup,
            "arrivals": self.arrivals,
            "placed": self.placed,
            "failed": self.failed,
            "completed": self.completed,
            "queued_at_end": self.queued_at_end,
            "max_queue": self.max_queue,
            "mean_wait_seconds": round(self.mean_wait_seconds, 3),
            "time_avg_allocated_gpu_pct": round(self.time_avg_allocated_pct, 3),
            "final_allocated_gpu_pct": round(self.final_allocated_pct, 3),
            "reevaluations": self.reevaluations,
            "decisions": self.decisions,
            "decisions_per_second": round(self.decisions_per_second, 1),
            "waits_by_class": {k: v.as_dict() for k, v in self.waits.items()},
        }


@dataclass(order=True, slots=True)
class _Event:
    time: float
    kind: EventKind
    seq: int
    arrival: Arrival | None = field(default=None, compare=False)
    name: str = field(default="", compare=False)
    epoch: int = field(default=0, compare=False)


class ChurnSimulation:
    """Arrivals, departures and periodic re-evaluation of one scheduler on simulated time."""

    def __init__(
        self,
        scheduler: Scheduler,
        arrivals: Iterable[Arrival],
        *,
        until: float,
        clock: ManualClock | None = None,
        queue: bool = False,
        period: float = 5.0,
        hooks: Sequence[ReevaluationHook] | None = None,
        warmup: float = 0.0,
        admission: Callable[[Request], Decision] | None = None,
        on_release: Callable[[ChurnSimulation, int], None] | None = None,
    ) -> None:
        if until <= 0:
            raise ValueError(f"until must be > 0 simulated seconds, got {until}")
        if not 0 <= warmup < until:
            raise ValueError(f"warmup must lie in [0, until={until}), got {warmup}")
        if period <= 0:
            raise ValueError(f"the re-evaluation period must be > 0 seconds, got {period}")
        self.scheduler = scheduler
        self.state = scheduler.state
        self.admission: Callable[[Request], Decision] = admission if admission is not None else scheduler.schedule
        """Places (and commits) an arrival or a retried request, or says it fits nowhere now."""
        self.on_release = on_release
        """Called with the node's index after a departure freed capacity there (with ``queue``)."""
        self.clock = clock if clock is not None else ManualClock()
        self.queue = queue
        self.period = period
        self.hooks: tuple[ReevaluationHook, ...] = (
            tuple(hooks) if hooks is not None else ((retry_pending,) if queue else ())
        )
        self.until = until
        self.warmup = warmup
        self.pending: deque[Pending] = deque()
        self.running: dict[str, Running] = {}
        self.timeline: list[tuple[float, int]] = [(self.clock.monotonic(), self.state.allocated_gpu_milli)]
        """(time, allocated milli-GPU) after every event that changed the allocation."""
        self._arrivals: Iterator[Arrival] = iter(arrivals)
        self._heap: list[_Event] = []
        self._seq = 0
        self._epoch = 0
        self._area = 0.0
        self._last = self.clock.monotonic()
        self._counts = {"arrivals": 0, "placed": 0, "failed": 0, "completed": 0, "ticks": 0, "max_queue": 0}
        self._wait_total = 0.0
        self._waits: dict[str, list[float]] = {}
        self._decisions = 0
        self._decision_seconds = 0.0

    # ---- API for re-evaluation hooks -------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def try_place(self, request: Request, lifetime: float, *, since: float | None = None) -> bool:
        """Ask :attr:`admission` to place ``request`` now; on success it runs for ``lifetime`` seconds."""
        started = time.perf_counter()
        decision = self.admission(request)
        self._decision_seconds += time.perf_counter() - started
        self._decisions += 1
        if decision.placement is None:
            return False
        self._start(request, lifetime, since if since is not None else self.now)
        return True

    def take_pending(self) -> list[Pending]:
        """Remove and return everything pending (a hook that places them itself puts back what it can't)."""
        items = list(self.pending)
        self.pending.clear()
        return items

    def start_placed(self, request: Request, lifetime: float, *, since: float) -> None:
        """Record that a hook placed ``request`` itself (already allocated in the state) and start its clock."""
        if request.name not in self.state.allocations:
            raise ValueError(f"request {request.name!r} is not allocated; place it before starting it")
        self._start(request, lifetime, since)

    def evict(self, name: str, *, requeue: bool = True) -> Request:
        """Stop running request ``name`` and release it; re-queue it with the lifetime it has left."""
        running = self.running.pop(name)
        self.state.release(name)
        if requeue:
            self.pending.append(Pending(running.request, max(running.departs - self.now, 0.0), self.now))
        self._note_allocation()
        return running.request

    # ---- the loop --------------------------------------------------------------------------------------

    def run(self) -> ChurnReport:
        """Run until ``until`` and report."""
        self._pull_arrival()
        if self.hooks:
            self._push(_Event(self.period, EventKind.TICK, self._next_seq()))
        while self._heap and self._heap[0].time <= self.until:
            event = heapq.heappop(self._heap)
            self._advance(event.time)
            if event.kind is EventKind.DEPARTURE:
                self._depart(event)
            elif event.kind is EventKind.TICK:
                self._counts["ticks"] += 1
                for hook in self.hooks:
                    hook(self)
                self._note_allocation()
                self._push(_Event(event.time + self.period, EventKind.TICK, self._next_seq()))
            else:
                assert event.arrival is not None
                self._arrive(event.arrival)
                self._pull_arrival()
            self._counts["max_queue"] = max(self._counts["max_queue"], len(self.pending))
        self._advance(self.until)
        return self._report()

    def _arrive(self, arrival: Arrival) -> None:
        self._counts["arrivals"] += 1
        if self.try_place(arrival.request, arrival.lifetime):
            return
        if self.queue:
            self.pending.append(Pending(arrival.request, arrival.lifetime, arrival.time))
        else:
            self._counts["failed"] += 1

    def _depart(self, event: _Event) -> None:
        running = self.running.get(event.name)
        if running is None or running.epoch != event.epoch:
            return  # evicted (and maybe restarted) since this departure was scheduled
        del self.running[event.name]
        node = self.state.release(event.name).node_index
        self._counts["completed"] += 1
        self._note_allocation()
        if self.on_release is not None and self.pending:
            self.on_release(self, node)

    def _start(self, request: Request, lifetime: float, since: float) -> None:
        now = self.now
        self._epoch += 1
        self.running[request.name] = Running(request, now, now + lifetime, self._epoch)
        self._counts["placed"] += 1
        self._wait_total += now - since
        if since >= self.warmup:
            self._waits.setdefault(wait_class(request), []).append(now - since)
        self._push(_Event(now + lifetime, EventKind.DEPARTURE, self._next_seq(), name=request.name, epoch=self._epoch))
        self._note_allocation()

    def _pull_arrival(self) -> None:
        arrival = next(self._arrivals, None)
        if arrival is not None and arrival.time <= self.until:
            if arrival.time < self.now:
                raise ValueError(f"arrivals must come in time order: {arrival.request.name} at {arrival.time}")
            self._push(_Event(arrival.time, EventKind.ARRIVAL, self._next_seq(), arrival=arrival))

    def _advance(self, to: float) -> None:
        """Move the clock to ``to``, accruing allocated milli-GPU × seconds inside the measured window."""
        start = max(self._last, self.warmup)
        if to > start:
            self._area += self.state.allocated_gpu_milli * (to - start)
        if to > self._last:
            self.clock.advance(to - self._last)
            self._last = to

    def _note_allocation(self) -> None:
        allocated = self.state.allocated_gpu_milli
        if self.timeline[-1][1] != allocated:
            self.timeline.append((self.now, allocated))

    def _push(self, event: _Event) -> None:
        heapq.heappush(self._heap, event)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _report(self) -> ChurnReport:
        capacity = self.state.total_gpu_milli
        window = self.until - self.warmup
        placed = self._counts["placed"]
        return ChurnReport(
            until=self.until,
            warmup=self.warmup,
            arrivals=self._counts["arrivals"],
            placed=placed,
            failed=self._counts["failed"],
            completed=self._counts["completed"],
            queued_at_end=len(self.pending),
            max_queue=self._counts["max_queue"],
            mean_wait_seconds=self._wait_total / placed if placed else 0.0,
            time_avg_allocated_pct=100.0 * self._area / (capacity * window) if capacity else 0.0,
            final_allocated_pct=100.0 * self.state.allocated_gpu_milli / capacity if capacity else 0.0,
            reevaluations=self._counts["ticks"],
            decisions=self._decisions,
            decision_seconds=self._decision_seconds,
            waits=self._wait_report(),
        )

    def _wait_report(self) -> dict[str, WaitStats]:
        queued: dict[str, list[float]] = {}
        for item in self.pending:
            if item.since >= self.warmup:
                queued.setdefault(wait_class(item.request), []).append(self.now - item.since)
        return {
            k: _wait_stats(self._waits.get(k, ()), queued.get(k, ()))
            for k in WAIT_CLASSES
            if k in self._waits or k in queued
        }
