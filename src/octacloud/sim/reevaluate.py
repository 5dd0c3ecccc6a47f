"""Churn mode driven by the scheduler's re-evaluation loop (:mod:`octacloud.scheduler.loop`).

:class:`LoopHook` is a :class:`~octacloud.sim.churn.ReevaluationHook`: every period it hands the pending queue to
:meth:`ReevaluationLoop.run_pass` and starts what the pass placed; between passes, :meth:`LoopHook.released`
hands what a departure freed to the queue first (:meth:`ReevaluationLoop.offer`), as the cloud's controller, woken
by a released slice while replicas wait, does. Moves made by defragmentation keep each
replica's name, so its departure still applies; the hook counts them. Synthetic churn requests all have the same
priority, so preemption has nothing to do here; victims, if a caller's requests had priorities, are stopped and
re-queued with the lifetime they have left.
"""

from __future__ import annotations

from collections import deque

from octacloud.scheduler.actions.defragment import Move
from octacloud.scheduler.loop import Evict, PassReport, ReevaluationLoop, Start
from octacloud.sim.churn import ChurnSimulation, Pending


class LoopHook:
    """Runs one loop pass per re-evaluation tick of a :class:`ChurnSimulation`."""

    def __init__(self, loop: ReevaluationLoop) -> None:
        self.loop = loop
        self.moves = 0
        self.moved_gpu_milli = 0
        self.pass_seconds = 0.0
        self.last: PassReport | None = None
        """The latest pass's report (its operations are what was carried out)."""

    def __call__(self, sim: ChurnSimulation) -> None:
        items = sim.take_pending()
        waiting = {item.request.name: item for item in items}
        report = self.last = self.loop.run_pass(sim.now, [item.request for item in items])
        for op in report.operations:  # simulated time: a move, a stop and a start take no time
            if isinstance(op, Evict):
                running = sim.running.pop(op.victim.request.name)  # already released by the preemption
                left = max(running.departs - sim.now, 0.0)
                waiting[op.victim.request.name] = Pending(running.request, left, sim.now)
            elif isinstance(op, Move):
                self.moves += 1
                self.moved_gpu_milli += op.request.total_gpu_milli
            elif isinstance(op, Start):
                item = waiting.pop(op.request.name)
                sim.start_placed(item.request, item.lifetime, since=item.since)
        sim.pending.extend(waiting[r.name] for r in report.pending)
        self.pass_seconds += report.seconds

    def released(self, sim: ChurnSimulation, node: int) -> None:
        """A departure freed capacity on ``node``: the queue gets it first (:meth:`ReevaluationLoop.offer`)."""
        items = list(sim.pending)
        decisions = self.loop.offer(node, [item.request for item in items])
        if not decisions:
            return
        by_name = {item.request.name: item for item in items}
        placed = {d.request.name for d in decisions}
        sim.pending = deque(item for item in items if item.request.name not in placed)
        for d in decisions:
            item = by_name[d.request.name]
            sim.start_placed(item.request, item.lifetime, since=item.since)
