"""Health: every ``health_interval_s`` the controller checks each replica that runs, and restarts failed ones.

* a process that exited, a start that failed, a model that failed to load, or a replica not ready within
  ``startup_timeout_s`` is FAILED at once (the gateway stops routing to it);
* a READY replica is FAILED after ``probe_failures_to_fail`` failed readiness probes in a row; it is probed once
  every ``ready_probe_interval_s``, at a phase of its own (the fleet's probes spread over the interval), and at
  every check while its latest probe failed or once the gateway ejected it; a starting replica at every check;
* a FAILED replica restarts on its own slice once its back-off (``backoff_base_s`` × 2^restarts, at most
  ``backoff_max_s``) has passed, checked at every health tick rather than at the next full reconcile; one whose
  card or node is unusable goes back to pending (it may use the failover headroom);
* a placed replica whose slice has become free starts;
* a surge replica that becomes READY moves its replacement on; one that fails undoes it (:mod:`.replacement`).

The probes a check makes run concurrently (at most :data:`PROBES_AT_ONCE` at a time), each bounded by
``probe_timeout_s``; starts and restarts too (at most :data:`~.lifecycle.LAUNCHES_AT_ONCE`); a deployment whose
replicas became ready is routed once per check, not once per replica. A launcher that can ``refresh`` what its
``alive`` reads (the emulated fleet's listing of each replica host) is asked to in a thread before the check.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from octacloud.control.controller.contracts import ControllerSettings, Probe, Prober, Wakeup
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.lifecycle import LAUNCHES_AT_ONCE, Lifecycle
from octacloud.control.controller.replacement import Replacements
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore, copied
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.launcher import LaunchFailedError, ReplicaLauncher
from octacloud.core.clock import Clock
from octacloud.core.errors import NotFoundError
from octacloud.observability.replicas import bounded_gather

PROBES_AT_ONCE = 128
"""Readiness probes in flight at once (all of a fleet's at once wait in the replicas' queues past their timeout)."""


@dataclass(slots=True)
class _Runtime:
    """Per-replica bookkeeping that need not survive a controller restart."""

    probe_failures: int = 0
    """Failed readiness probes in a row (reset by one that passes)."""
    next_restart_at: float = 0.0
    """When a FAILED replica may restart."""
    next_probe_at: float = 0.0
    """When a READY replica is probed next (a replica seen afresh is probed at once)."""


class HealthChecker:
    def __init__(
        self,
        *,
        store: ControllerStore,
        launcher: ReplicaLauncher,
        prober: Prober,
        lifecycle: Lifecycle,
        replacements: Replacements,
        reservations: Reservations,
        events: EventLog,
        clock: Clock,
        settings: ControllerSettings,
        wakeup: Wakeup,
    ) -> None:
        self.store, self.launcher, self.prober = store, launcher, prober
        self.lifecycle, self.replacements, self.reservations = lifecycle, replacements, reservations
        self.events, self.clock, self.settings, self.wakeup = events, clock, settings, wakeup
        self._runtime: dict[str, _Runtime] = {}

    def _rt(self, replica_id: str) -> _Runtime:
        return self._runtime.setdefault(replica_id, _Runtime())

    async def check(self) -> None:
        refresh = getattr(self.launcher, "refresh", None)  # one that can: what ``alive`` reads, fetched off the loop
        if refresh is not None:
            await asyncio.to_thread(refresh)
        now = self.clock.monotonic()
        probing: list[Replica] = []
        launching: list[Coroutine[Any, Any, None]] = []
        replicas = sorted(self.store.peek_replicas(), key=lambda r: r.id)  # (a look at each; copies of those acted on)
        for gone in self._runtime.keys() - {r.id for r in replicas}:
            del self._runtime[gone]
        for r in replicas:
            if self.lifecycle.is_stopping(r.id):
                continue
            if r.state is ReplicaState.FAILED:
                if now >= self._rt(r.id).next_restart_at:
                    launching.append(self.restart(copied(r)))
                continue
            if r.state is ReplicaState.PENDING and r.placed and self.lifecycle.room_is_free(r):
                launching.append(self._start_placed(copied(r)))
                continue
            if r.state not in (ReplicaState.STARTING, ReplicaState.READY) or not r.handle:
                continue
            if not self.launcher.alive(r.handle):
                why = self.lifecycle.exit_reason(r.handle)
                self.failed(copied(r), f"process exited: {why}" if why else "process exited")
            elif r.http_port:
                if self._due(r, now):
                    probing.append(r)
            elif self._addressed(c := copied(r), now):
                probing.append(c)
        await self.launch_all(launching)
        timeout = self.settings.probe_timeout_s
        # a few at a time: a fleet's probes at once wait in the replicas' queues past their timeout
        results = await bounded_gather((self.prober.probe(r, r.deployment, timeout) for r in probing), PROBES_AT_ONCE)
        route: set[str] = set()
        for r, probe in zip(probing, results, strict=True):
            if isinstance(probe, BaseException):
                raise probe
            if self.lifecycle.is_stopping(r.id):
                continue
            if probe.ready and r.state is ReplicaState.READY:  # serving as it was: nothing to change
                rt = self._rt(r.id)
                rt.probe_failures, rt.next_probe_at = 0, self._next_probe(r.id, now)
            else:
                self._judge(copied(r), probe, now, route)
        for deployment in sorted(route):
            self.lifecycle.route(deployment)

    def probe_soon(self, replica_id: str) -> None:
        """The gateway ejected ``replica_id``: probe it at the next check, not at its turn (a probe that passes ends
        the ejection at once)."""
        rt = self._runtime.get(replica_id)
        if rt is not None:
            rt.next_probe_at = 0.0

    def _due(self, r: Replica, now: float) -> bool:
        """Whether ``r`` is probed in this check: a starting one always; a READY one at its turn, or while failing."""
        if r.state is not ReplicaState.READY:
            return True
        rt = self._rt(r.id)
        return rt.probe_failures > 0 or now >= rt.next_probe_at

    def _next_probe(self, replica_id: str, now: float) -> float:
        """The next turn of a READY replica that passed its probe at ``now``: the next instant after ``now`` at its
        own phase within ``ready_probe_interval_s`` (from its id, so the fleet's turns are spread evenly)."""
        every = self.settings.ready_probe_interval_s
        if every <= 0:
            return now
        phase = every * zlib.crc32(replica_id.encode()) / 2**32
        return now + every - (now + phase) % every

    @staticmethod
    async def launch_all(launches: Iterable[Coroutine[Any, Any, None]]) -> None:
        """Run ``launches`` (starts, restarts), :data:`LAUNCHES_AT_ONCE` at a time; the first that raised is raised
        once all have ended (a failed launch fails its replica and raises nothing: what raises is the store)."""
        for outcome in await bounded_gather(launches, LAUNCHES_AT_ONCE):
            if isinstance(outcome, BaseException):
                raise outcome

    async def _start_placed(self, r: Replica) -> None:
        try:
            d = self.store.get_deployment(r.deployment)
        except NotFoundError:
            return  # removed meanwhile: the next reconcile retires it
        await self.start(r, d)

    def _addressed(self, r: Replica, now: float) -> bool:
        """A remote replica reports where it serves once it has started: whether it has (and may be probed)."""
        try:
            address = self.launcher.address(r.handle)
        except LaunchFailedError as exc:
            self.failed(r, f"start failed: {exc}", kill=True)
            return False
        if address is None:
            if now - r.started_at > self.settings.startup_timeout_s:
                self.failed(r, f"not started after {self.settings.startup_timeout_s:g} s", kill=True)
            return False
        self.lifecycle.addressed(r, address)
        return True

    def _judge(self, r: Replica, probe: Probe, now: float, route: set[str]) -> None:
        """Act on ``r``'s probe; ``route`` collects the deployments to route once the check has judged them all."""
        rt = self._rt(r.id)
        timeout = self.settings.startup_timeout_s
        if probe.ready:
            rt.probe_failures, rt.next_probe_at = 0, self._next_probe(r.id, now)
            if r.state is ReplicaState.STARTING:
                r.state, r.last_ready_at, r.message = ReplicaState.READY, self.clock.time(), ""
                self.store.put_replica(r)
                self.events.replica("ready", r, f"serving on {r.node} cards {list(r.gpus)}")
                if r.replaces:
                    self.replacements.ready(r)
                else:
                    route.add(r.deployment)
        elif r.state is ReplicaState.STARTING:
            if probe.failed:
                self.failed(r, f"model failed to load: {probe.failed}", kill=True)
            elif now - r.started_at > timeout:
                self.failed(r, f"not ready after {timeout:g} s", kill=True)
        else:
            rt.probe_failures += 1
            if rt.probe_failures >= self.settings.probe_failures_to_fail:
                self.failed(r, f"{rt.probe_failures} readiness probes failed", kill=True)

    async def start(self, r: Replica, d: Deployment) -> None:
        """Launch ``r`` on its slice; a launch that fails fails the replica."""
        why = await self.lifecycle.launch(r, d)
        if why:
            self.failed(r, why)
        elif r.state is ReplicaState.STARTING:  # launched: its probes count afresh
            self._runtime[r.id] = _Runtime()

    def failed(self, r: Replica, why: str, *, kill: bool = False) -> None:
        """``r`` died or will never be ready: stop routing to it; restart it with back-off, or (a surge replica)
        undo its replacement. ``kill``: its process may still run and is stopped in the background."""
        self.lifecycle.unroute(r.id, gone=True)
        if kill and r.handle:
            self.lifecycle.kill(r.handle)
        if r.replaces:
            self.replacements.failed(r, why)
            return
        s = self.settings
        delay = min(s.backoff_max_s, s.backoff_base_s * 2 ** min(r.restarts, 16))
        self._rt(r.id).next_restart_at = self.clock.monotonic() + delay
        r.state, r.handle, r.pid, r.message = ReplicaState.FAILED, "", None, why
        self.store.put_replica(r)
        self.events.replica("failed", r, f"{why}; restart in {delay:g} s")
        self.lifecycle.route(r.deployment)

    async def restart(self, r: Replica) -> None:
        """Restart FAILED ``r`` on its slice, or send it back to pending when its slice is gone or unusable."""
        try:
            d = self.store.get_deployment(r.deployment)
        except NotFoundError:
            return  # an orphan: the next reconcile removes it
        if not r.placed:
            r.unplace(r.message, r.failover)
            self.store.put_replica(r)
            return
        if not self.reservations.usable(r):
            self.reservations.release(r.id)
            r.unplace(f"card on {r.node} unusable", failover=True)
            self.store.put_replica(r)
            self.wakeup.poke()
            return
        r.restarts += 1
        self.events.replica("restart", r, f"restart #{r.restarts} on {r.node}")
        await self.start(r, d)
