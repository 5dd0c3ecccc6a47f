"""Placing what waits: the pending replicas go to the scheduler's re-evaluation loop (place by priority →
preempt → defragment), and the executor carries out the operations the pass returns, in order (the scheduler's
state already holds their outcome):

* **evict**: the victim is drained and stopped, then waits to be placed again;
* **move**: a running replica is replaced by make-before-break on its new slice (:mod:`.replacement`); one that
  runs nothing just takes its new slice;
* **start**: the replica takes its slice and starts once what still occupies that slice (``after``) has left; the
  starts a pass can make at once are launched together once every operation is carried out, a few at a time
  (:meth:`~.health.HealthChecker.launch_all`).
"""

from __future__ import annotations

from collections.abc import Sequence

from octacloud.control.controller.contracts import Wakeup
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.health import HealthChecker
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.replacement import Replacements
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.core.clock import Clock
from octacloud.core.model import Placement, Request
from octacloud.observability.scheduling import Outcome, SchedulingStats
from octacloud.scheduler.actions.defragment import Move
from octacloud.scheduler.loop import Evict, PassOperation, PassReport, ReevaluationLoop, Start


class Executor:
    def __init__(
        self,
        *,
        store: ControllerStore,
        loop: ReevaluationLoop,
        lifecycle: Lifecycle,
        replacements: Replacements,
        health: HealthChecker,
        reservations: Reservations,
        events: EventLog,
        clock: Clock,
        scheduling: SchedulingStats,
        wakeup: Wakeup,
    ) -> None:
        self.store, self.loop, self.lifecycle, self.replacements = store, loop, lifecycle, replacements
        self.health, self.reservations, self.events = health, reservations, events
        self.clock, self.scheduling, self.wakeup = clock, scheduling, wakeup
        self.last: PassReport | None = None
        """The latest pass's report (what the executor was asked to carry out)."""

    async def place(
        self, deployments: dict[str, Deployment], waiting: list[Replica], requests: dict[str, Request]
    ) -> None:
        """Hand the replicas ``waiting`` to be placed (``requests``: the scheduler's request for each, by id) to the
        loop's pass and carry out what it decides."""
        report = self.last = self.loop.run_pass(self.clock.monotonic(), list(requests.values()))
        self.wakeup.waiting = sum(1 for r in report.pending if r.name in requests)
        per_decision = report.seconds / max(1, len(requests))
        evicted = {op.victim.request.name for op in report.operations if isinstance(op, Evict)}
        for op in report.operations:
            if isinstance(op, Start):
                preempted = any(a in evicted for a in op.after)
                self.scheduling.decision(Outcome.PREEMPTED if preempted else Outcome.PLACED, per_decision)
        by_id = {r.id: r for r in waiting}
        for request in report.pending:
            if request.name not in requests:  # a victim of this pass: it is re-queued by its stop
                continue
            self.scheduling.decision(Outcome.UNSCHEDULABLE, per_decision)
            r = by_id[request.name]
            why = self.reservations.scheduler.decide(request).explain()
            if r.message != why:
                r.message = why
                self.store.put_replica(r)
                self.events.replica("unschedulable", r, why)
        await self.execute(report.operations, deployments)

    async def execute(self, operations: Sequence[PassOperation], deployments: dict[str, Deployment]) -> None:
        """Carry out a pass's operations, in order."""
        self.replacements.new_pass()
        by_id = {r.id: r for r in self.store.replicas()} if operations else {}
        starts: list[tuple[Replica, Deployment]] = []
        for op in operations:
            if isinstance(op, Evict):
                victim = by_id.get(op.victim.request.name)
                if victim is not None:
                    self.scheduling.preempted(1)
                    self.events.replica("preempted", victim, f"by {op.by}")
                    self.lifecycle.retire(victim, f"preempted by {op.by}", then="pending")
            elif isinstance(op, Move):
                mover = by_id.get(op.request.name)
                if mover is not None and mover.deployment in deployments:
                    await self._move(mover, op.destination, deployments[mover.deployment])
            elif isinstance(op, Start):
                self._start(op, by_id, deployments, starts)
        await self.health.launch_all(self.health.start(r, d) for r, d in starts)

    async def _move(self, mover: Replica, destination: Placement, d: Deployment) -> None:
        if mover.handle and mover.state is not ReplicaState.STOPPING:
            await self.replacements.begin_move(mover, destination, d)
            return
        mover.node, mover.gpus, mover.milli_per_gpu = destination.node, destination.gpus, destination.milli_per_gpu
        self.store.put_replica(mover)  # nothing runs: it just has a new slice
        self.scheduling.moved()
        self.events.replica("moved", mover, f"to {destination.node} cards {list(destination.gpus)} (not running)")

    def _start(
        self,
        op: Start,
        by_id: dict[str, Replica],
        deployments: dict[str, Deployment],
        starts: list[tuple[Replica, Deployment]],
    ) -> None:
        """Give ``op``'s replica its slice; one whose slice is free joins ``starts``."""
        r = by_id.get(op.request.name)
        if r is None or r.deployment not in deployments:
            self.reservations.release(op.request.name)
            return
        if self.replacements.homeless(op.after):  # a move that made its room failed at once
            self.reservations.release(r.id)
            for a in op.after:
                self.replacements.rehome(a)
            return
        p = op.placement
        running = [a for a in op.after if self.lifecycle.is_stopping(a) or (a in by_id and by_id[a].handle)]
        r.node, r.gpus, r.milli_per_gpu, r.message, r.after = p.node, p.gpus, p.milli_per_gpu, "", running
        r.state = ReplicaState.PENDING
        if self.lifecycle.is_stopping(r.id):  # a victim of this pass placed again: it starts once its old self left
            r.after.append(r.id)
            r.handle, r.pid, r.host, r.http_port, r.grpc_port, r.metrics_port = "", None, "", None, None, None
        self.store.put_replica(r)
        waits = f" once {', '.join(op.after)} left" if op.after else ""
        self.events.replica("placed", r, f"{p.node} cards {list(p.gpus)} × {p.milli_per_gpu} milli{waits}")
        if self.lifecycle.room_is_free(r):
            starts.append((r, deployments[r.deployment]))
        else:  # it waits for its slice: its model downloads to the node meanwhile
            self.lifecycle.prefetch(r.node, *r.runs(deployments[r.deployment])[:2])
