"""Adoption: what a controller does once at start, over the store a previous controller left (perhaps killed
with ``kill -9``) and the replicas that live on.

1. the replacements that were in flight are sorted out: undone (the source still serves and its replacement
   does not) or forgotten now, the others carried on in step 4 (:mod:`.replacement`);
2. every placed replica takes its slice back in the scheduler's state, those that run first; a replica that
   should run and does not is FAILED (it restarts with back-off); one whose slice is no longer free is re-placed;
3. every deployment is routed to its READY replicas;
4. the replacements to carry on go on from the phase they had reached;
5. a replica process that runs but that no record names (launched the moment before the previous controller
   died, its handle never stored) is stopped.
"""

from __future__ import annotations

from octacloud.control.controller.contracts import FootprintSource, log
from octacloud.control.controller.deploys import route
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.replacement import Replacements
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import ReplicaState
from octacloud.control.launcher import ReplicaLauncher
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.gateway.routing import RouteTable


class Adoption:
    def __init__(
        self,
        *,
        store: ControllerStore,
        launcher: ReplicaLauncher,
        lifecycle: Lifecycle,
        replacements: Replacements,
        reservations: Reservations,
        routes: RouteTable,
        events: EventLog,
        footprint: FootprintSource,
    ) -> None:
        self.store, self.launcher, self.lifecycle, self.footprint = store, launcher, lifecycle, footprint
        self.replacements, self.reservations, self.routes, self.events = replacements, reservations, routes, events

    def adopt(self) -> None:
        for d in self.store.deployments():
            route(self.routes, self.footprint, d.spec)
        carry_on = self.replacements.sort_out()
        moved_away = {t.source for t, _ in carry_on if t.kind == "move"}  # their slice is someone else's already
        for r in sorted(self.store.replicas(), key=lambda r: not r.handle):  # what runs keeps its slice first
            if not r.placed or self.reservations.holds(r.id) or r.id in moved_away:
                continue
            try:
                self.reservations.reserve(r, self.store.get_deployment(r.deployment))
            except (InvalidSpecError, NotFoundError) as exc:
                log.warning("replica %s: cannot re-account its slice (%s); re-placing it", r.id, exc)
                r.unplace(f"slice lost across restart: {exc}")
                self.store.put_replica(r)
                continue
            if not r.handle and r.pid is not None:  # stored before launchers had handles: a local PID
                r.handle = str(r.pid)
            if r.state is ReplicaState.PENDING:
                continue  # placed, waiting for its slice to be free: launched by the health check
            if not r.handle or not self.launcher.alive(r.handle):
                r.state, r.handle, r.pid = ReplicaState.FAILED, "", None
                r.message = "not running after controller restart"
                self.store.put_replica(r)
        for d in self.store.deployments():
            self.lifecycle.route(d.spec.name)
        for t, plan in carry_on:
            self.replacements.carry_on(t, plan)
        self._stop_strays()

    def _stop_strays(self) -> None:
        """Stop the replicas that run but that the store does not know (a launcher that cannot tell its cloud's
        replicas from others' finds none)."""
        running = self.launcher.handles()
        if not running:
            return
        known: set[str] = set()
        for r in self.store.replicas():
            if r.handle:
                known.add(r.handle)
            if r.pid is not None:  # records from before handles
                known.add(str(r.pid))
        for handle in running:
            if handle not in known:
                log.warning("replica process %s runs but no replica of the store has it: stopping it", handle)
                self.lifecycle.kill(handle)
                self.events.record(
                    "stray replica stopped", handle, "it ran without a record (launched just before a restart)"
                )
