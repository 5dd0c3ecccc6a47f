"""The re-evaluation loop: every ``period`` seconds, re-evaluate the whole cluster (pure; no I/O, no asyncio).

One pass over a :class:`ClusterState` (through its :class:`Scheduler`) and the pending requests:

1. **place**: pending requests in order of priority (highest first), then arrival (the caller's order). The first
   ``reservations`` requests that fit nowhere (whole cards only) each *reserve* the node where they will fit
   soonest (:mod:`octacloud.scheduler.actions.reservation`): later requests of no higher priority — in this pass,
   and arrivals admitted between passes through :meth:`ReevaluationLoop.admit` — may *backfill* that node only
   where they do not delay the reservation. A reservation lasts until its holder is placed or leaves the queue;
   one that has not come closer (no replica left its cards) for ``reservation_passes`` passes is chosen again;
2. **preempt**: a request still unplaced that outranks running work may evict the cheapest lower-priority set
   on one node (:func:`octacloud.scheduler.actions.preempt.preempt`); the victims join the pending list;
3. **defragment**: within a budget of moves per pass, a reservation's holder first has its reserved node cleared
   (every replica on its cards moved elsewhere, all or nothing, then the holder placed there); another request
   still unplaced may move running replicas elsewhere (:func:`octacloud.scheduler.actions.defragment.
   defragment`), never onto or off a reserved node.

After the pass the queue is handed to the profile's :class:`~octacloud.scheduler.framework.api.DemandObserver`
plugins (the policy may weigh what waits).

Within a pass, a request shape that failed a step is not retried at that step (fit is monotone while the pass
only fills the cluster and adds reservations), which keeps a long queue of few shapes cheap. The caller owns the
queue and the clock: the cloud's controller and the simulator's churn mode call :meth:`ReevaluationLoop.due` and
:meth:`run_pass`, and place new work between passes only through :meth:`ReevaluationLoop.admit` (the controller
places nothing between passes: a new replica waits for the pass its creation wakes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Placement, Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.actions.defragment import DEFAULT_MAX_MOVES, Move, defragment, move_off, move_to, shadow_of
from octacloud.scheduler.actions.preempt import preempt
from octacloud.scheduler.actions.reservation import Reservation, choose, conflicts
from octacloud.scheduler.framework.api import DemandObserver
from octacloud.scheduler.framework.runner import Decision, Scheduler
from octacloud.scheduler.framework.state import Allocation
from octacloud.scheduler.framework.transaction import Transaction
from octacloud.scheduler.pairing import best_remainder, lone_shares

DEFAULT_PERIOD = 5.0
"""Seconds between passes (the design's loop)."""
DEFAULT_MOVES_PER_PASS = 16
DEFAULT_DEFRAG_ATTEMPTS = 4
DEFAULT_RESERVATIONS = 1
DEFAULT_RESERVATION_PASSES = 24


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
    reservations: int = DEFAULT_RESERVATIONS
    """Pending requests (oldest of the highest priority first) that may each hold a reservation (0: none, the
    plain greedy discipline: whatever fits is placed, in queue order)."""
    reservation_passes: int = DEFAULT_RESERVATION_PASSES
    """Passes a reservation lasts without coming closer (no blocker left its cards) before it is chosen again."""
    pair_shares: bool = True
    """With defragmentation: after the queue's own plans, move a share that is alone on its card into a remainder
    on another node where it fits best, when that frees the card for a waiting whole-card request."""

    def __post_init__(self) -> None:
        if not self.period > 0:
            raise InvalidSpecError(f"loop: period must be > 0 seconds, got {self.period}")
        if self.defrag_attempts < 0:
            raise InvalidSpecError(f"loop: defrag_attempts must be >= 0, got {self.defrag_attempts}")
        if self.moves_per_pass < 0 or self.moves_per_request < 0:
            raise InvalidSpecError(
                f"loop: move budgets must be >= 0, got {self.moves_per_pass} per pass, {self.moves_per_request} each"
            )
        if self.reservations < 0 or self.reservation_passes < 1:
            raise InvalidSpecError(
                f"loop: need reservations >= 0 and reservation_passes >= 1, got {self.reservations} and "
                f"{self.reservation_passes}"
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
    reservations: list[Reservation] = field(default_factory=list)
    """Reservations held after the pass, in the holders' queue order."""


def _shape(r: Request) -> tuple[object, ...]:
    """What decides whether a request fits: requests of one shape fail alike (a group's replicas are kept apart
    from each other, so the group is part of it)."""
    return (r.num_gpu, r.gpu_milli, r.gpu_memory_mib, r.cpu_milli, r.memory_mib, r.gpu_models, r.priority, r.failover,
            r.group, r.spread)  # fmt: skip


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
        self.reserved: dict[str, Reservation] = {}
        """Pending request name → its reservation (kept across passes)."""
        self._observers = [p for p in scheduler.profile.plugins() if isinstance(p, DemandObserver)]
        """The profile's plugins that are told the queue after every pass."""

    def due(self, now: float) -> bool:
        """True when a pass should run at ``now`` (the first call is always due)."""
        return self._next is None or now >= self._next

    def run_pass(self, now: float, pending: Sequence[Request]) -> PassReport:
        """Re-evaluate the cluster at time ``now`` with ``pending`` waiting; schedules the next pass."""
        started = self._timer()
        s = self.settings
        report = PassReport(now)
        queue = sorted(pending, key=lambda r: -r.priority)  # stable: arrival order within a priority
        self._expire(queue)
        failed: set[tuple[object, ...]] = set()
        waiting: list[Request] = []
        for r in queue:
            own = self.reserved.get(r.name)
            decision = None if own is None and _shape(r) in failed else self._place(r)
            if decision is None or decision.placement is None:
                if own is None:
                    failed.add(_shape(r))
                    if len(self.reserved) < s.reservations:
                        self._reserve(r)
                waiting.append(r)
            else:
                self.reserved.pop(r.name, None)
                report.placed[r.name] = decision.placement
                report.operations.append(Start(decision.request, decision.placement))
        if s.preempt and waiting:
            waiting = self._preempt(waiting, report)
        if s.defragment and waiting and s.moves_per_pass > 0:
            waiting = self._defragment(waiting, report)
        for name in report.placed:
            self.reserved.pop(name, None)
        report.pending = waiting
        for plugin in self._observers:
            plugin.observe_queue(waiting)
        report.reservations = [self.reserved[r.name] for r in waiting if r.name in self.reserved]
        report.seconds = self._timer() - started
        self.passes += 1
        self.total_moves += len(report.moves)
        self._next = now + s.period
        return report

    def admit(self, request: Request) -> Decision:
        """Place ``request`` now if it fits without delaying a reservation of equal or higher priority (an
        arrival between passes); committed to the state when placed. Unplaced, it waits for the next pass."""
        return self._place(request)

    def offer(self, node: int, pending: Sequence[Request]) -> list[Decision]:
        """Work left node ``node`` between passes: place at once, in queue order (highest priority, then
        oldest), each pending request that fits there now, as a pass woken by the release would; the freed
        capacity goes to the queue before later arrivals. Placed as :meth:`admit` places (reservations kept);
        returns the committed decisions."""
        placed: list[Decision] = []
        failed: set[tuple[object, ...]] = set()
        for r in sorted(pending, key=lambda r: -r.priority):
            shape = _shape(r)
            if shape in failed:
                continue
            if self.scheduler.decide(r, [node]).placement is None:
                failed.add(shape)
                continue
            decision = self._place(r)
            if decision.placement is None:
                failed.add(shape)
                continue
            self.reserved.pop(r.name, None)
            placed.append(decision)
        return placed

    # ---- reservations ----------------------------------------------------------------------------------

    def _expire(self, queue: Sequence[Request]) -> None:
        """Drop reservations whose holder left the queue or changed, whose node is unusable, or that made no
        progress for ``reservation_passes`` passes; note progress (fewer blockers) on the others."""
        by_name = {r.name: r for r in queue}
        state, limit = self.scheduler.state, self.settings.reservation_passes
        for name, res in list(self.reserved.items()):
            r = by_name.get(name)
            if r is None or _shape(r) != _shape(res.request) or not state.node_usable[res.node]:
                del self.reserved[name]
                continue
            blocking = len(res.blockers(state))
            if blocking < res.blocking:
                self.reserved[name] = replace(res, made=self.passes, blocking=blocking)
            elif self.passes - res.made >= limit:
                del self.reserved[name]

    def _reserve(self, request: Request) -> None:
        taken = {res.node for res in self.reserved.values()}
        allow_pinned = self.settings.allow_pinned

        def movable(a: Allocation) -> bool:
            return (allow_pinned or not a.request.pinned) and a.request.priority <= request.priority

        s = self.settings
        res = choose(
            self.scheduler.state,
            request,
            made=self.passes,
            taken=taken,
            movable=movable,
            rank=self.scheduler.tie_rank,
            moves=s.defragment and s.moves_per_pass > 0,
        )
        if res is not None:
            self.reserved[request.name] = res

    def _place(self, request: Request) -> Decision:
        """Decide and commit ``request``: on its own reserved node first, elsewhere only where it delays no
        reservation of equal or higher priority held by another request."""
        scheduler, state = self.scheduler, self.scheduler.state
        own = self.reserved.get(request.name)
        if own is not None:
            decision = scheduler.decide(request, [own.node])
            if decision.placement is not None:
                scheduler.commit(decision.request, decision.placement)
                return decision
        guarded = {
            res.node: res
            for name, res in self.reserved.items()
            if name != request.name and res.request.priority >= request.priority
        }
        exclude: set[int] = set()
        while True:
            decision = scheduler.decide(request, exclude=exclude)
            if decision.placement is None:
                return decision
            i = state.node_index(decision.placement.node)
            res = guarded.get(i)
            if res is None or not conflicts(state, res, decision.request, decision.placement):
                scheduler.commit(decision.request, decision.placement)
                return decision
            exclude.add(i)

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
        """Serve the queue by moves: first clear each reserved node for its holder (queue order), then plan a
        room for other pending requests (:func:`defragment`), all within the pass's move budget."""
        s = self.settings
        budget, attempts = s.moves_per_pass, s.defrag_attempts
        cleared: list[Request] = []
        for r in waiting:
            res = self.reserved.get(r.name)
            if res is None or budget <= 0 or attempts <= 0:
                cleared.append(r)
                continue
            attempts -= 1
            used = self._clear(r, res, min(budget, s.moves_per_request), report)
            budget -= used
            if r.name not in report.placed:
                cleared.append(r)
        still: list[Request] = []
        failed: set[tuple[object, ...]] = set()
        avoid = {res.node for res in self.reserved.values()}
        for r in cleared:
            if budget <= 0 or attempts <= 0 or _shape(r) in failed or r.name in self.reserved:
                still.append(r)
                continue
            attempts -= 1
            outcome = defragment(
                self.scheduler,
                r,
                max_moves=min(budget, s.moves_per_request),
                allow_pinned=s.allow_pinned,
                avoid=avoid,
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
        if s.pair_shares and budget > 0 and s.defrag_attempts > 0:
            still = self._pair_shares(still, budget, report)
        return still

    def _pair_shares(self, waiting: list[Request], budget: int, report: PassReport) -> list[Request]:
        """Free whole cards for waiting whole-card requests by pairing shares: a share alone on its card moves
        (make-before-break) into the remainder on another node that it fills best, and the oldest waiting
        whole-card request that then fits on the freed card's node starts there; a move that lets nothing start is
        rolled back. Largest shares first (they fit the fewest remainders); reserved nodes are neither sources nor
        destinations. At most ``budget`` moves."""
        scheduler, state = self.scheduler, self.scheduler.state
        unplaced = [r for r in waiting if r.num_gpu >= 1 and r.name not in report.placed]
        wanting = [r for r in unplaced if not r.is_sharing] + [r for r in unplaced if r.is_sharing]
        if not wanting:
            return waiting
        allow_pinned = self.settings.allow_pinned
        top = max(r.priority for r in wanting)
        avoid = {res.node for res in self.reserved.values()}
        lone, remainders = lone_shares(state, avoid, allow_pinned, top)
        rank = scheduler.tie_rank
        paired: set[tuple[int, int]] = set()
        placed_names: set[str] = set()
        for (i, g), a in lone:
            if budget <= 0:
                break
            if (i, g) in paired or a.request.name not in state.allocations:
                continue
            r = a.request
            target = best_remainder(state, r, i, remainders, rank)
            if target is None:
                continue
            j, h = target
            shadow = shadow_of(r)
            if r.group and scheduler.decide(shadow, [j]).placement is None:
                continue  # the profile keeps it off that node (its deployment's replicas kept apart)
            with scheduler.transaction() as tx:
                move = move_to(tx, a, shadow, Placement(shadow.name, state.nodes[j].name, (h,), r.gpu_milli))
                started = self._start_freed(tx, wanting, placed_names, r.priority, i)
                if started is None or started.placement is None:
                    continue  # leaving the block without commit rolls the move back
                tx.commit()
            budget -= 1
            placed_names.add(started.request.name)
            report.moves.append(move)
            report.operations.append(move)
            report.placed[started.request.name] = started.placement
            report.operations.append(Start(started.request, started.placement, (r.name,)))
            paired.add((i, g))
            remainders.pop((i, g), None)
            left = state.free_gpu[j][h]
            if 0 < left < MILLI_PER_GPU:
                remainders[(j, h)] = left
            else:
                remainders.pop((j, h), None)
            paired.add((j, h))
        return [r for r in waiting if r.name not in placed_names]

    def _start_freed(
        self, tx: Transaction, wanting: list[Request], placed: set[str], priority: int, node: int
    ) -> Decision | None:
        """Allocate in ``tx``, on ``node`` (where a share just moved off), the first of ``wanting`` not yet
        ``placed`` and of at least ``priority`` that fits there; requests of a shape already tried are skipped."""
        tried: set[tuple[object, ...]] = set()
        for w in wanting:
            if w.name in placed or _shape(w) in tried or w.priority < priority:
                continue
            decision = self.scheduler.decide(w, [node])
            if decision.placement is not None:
                tx.allocate(decision.request, decision.placement)
                return decision
            tried.add(_shape(w))
        return None

    def _clear(self, holder: Request, res: Reservation, budget: int, report: PassReport) -> int:
        """Move every blocker off ``res``'s cards (smallest first, each to where the profile would place it off
        every reserved node) and place ``holder`` there, all or nothing within ``budget`` moves. Only when every
        blocker may be moved (pinning, priority): a reservation some blocker keeps is left to departures, and
        one with more blockers than the budget waits until departures leave few enough. Returns the moves made."""
        scheduler, state = self.scheduler, self.scheduler.state
        allow_pinned = self.settings.allow_pinned
        blockers = [state.allocations[name] for name in res.blockers(state)]
        if not blockers or len(blockers) > budget:
            return 0
        if any((a.request.pinned and not allow_pinned) or a.request.priority > holder.priority for a in blockers):
            return 0
        avoid = {r.node for r in self.reserved.values()}
        moved: list[Move] = []
        with scheduler.transaction() as tx:
            for a in sorted(blockers, key=lambda a: (a.request.total_gpu_milli, a.request.cpu_milli, a.request.name)):
                move = move_off(scheduler, tx, a, avoid)
                if move is None:
                    return 0  # the context manager rolls every move back
                moved.append(move)
            decision = scheduler.decide(holder, [res.node])
            if decision.placement is None:
                return 0
            tx.allocate(decision.request, decision.placement)
            tx.commit()
        report.moves.extend(moved)
        report.operations.extend(moved)
        report.placed[holder.name] = decision.placement
        report.operations.append(Start(decision.request, decision.placement, tuple(m.request.name for m in moved)))
        del self.reserved[holder.name]
        return len(moved)
