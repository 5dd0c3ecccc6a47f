"""Health: every ``health_interval_s`` the controller checks each replica that runs, and restarts failed ones.

* a process that exited, a start that failed, a model that failed to load, or a replica not ready within
  ``startup_timeout_s`` is FAILED at once (the gateway stops routing to it);
* a READY replica is FAILED after ``probe_failures_to_fail`` failed readiness probes in a row;
* a FAILED replica restarts on its own slice once its back-off (``backoff_base_s`` × 2^restarts, at most
  ``backoff_max_s``) has passed, checked at every health tick rather than at the next full reconcile; one whose
  card or node is unusable goes back to pending (it may use the failover headroom);
* a surge replica that becomes READY completes its replacement; one that fails rolls it back (see executor).

Probes of all replicas run concurrently, each bounded by ``probe_timeout_s``.
"""

from __future__ import annotations

import asyncio

from octacloud.control.controller.executor import Executor
from octacloud.control.controller.world import Probe, World
from octacloud.control.deployments import Replica, ReplicaState
from octacloud.control.launcher import LaunchFailedError
from octacloud.core.errors import NotFoundError


class HealthChecker:
    def __init__(self, world: World, executor: Executor) -> None:
        self.w = world
        self.x = executor

    async def check(self) -> None:
        w = self.w
        now = w.clock.monotonic()
        probing: list[Replica] = []
        for r in w.store.replicas():
            if r.id in w.stopping:
                continue
            if r.state is ReplicaState.FAILED:
                if now >= w.rt(r.id).next_restart_at:
                    await self.restart(r)
                continue
            if r.state is ReplicaState.PENDING and r.placed and self.x.room_is_free(r):
                try:
                    await self.x.launch(r, w.store.get_deployment(r.deployment))
                except NotFoundError:
                    pass
                continue
            if r.state not in (ReplicaState.STARTING, ReplicaState.READY) or not r.handle:
                continue
            if not w.launcher.alive(r.handle):
                why = getattr(w.launcher, "exit_reason", _untold)(r.handle)  # a launcher that can tell says why
                self.x.failed(r, f"process exited: {why}" if why else "process exited")
                continue
            if not r.http_port:  # a remote replica reports where it serves once it has started
                try:
                    address = w.launcher.address(r.handle)
                except LaunchFailedError as exc:
                    self.x.failed(r, f"start failed: {exc}", kill=True)
                    continue
                if address is None:
                    if now - r.started_at > w.settings.startup_timeout_s:
                        self.x.failed(r, f"not started after {w.settings.startup_timeout_s:g} s", kill=True)
                    continue
                self.x.addressed(r, address)
            probing.append(r)
        timeout = w.settings.probe_timeout_s
        results = await asyncio.gather(*(w.prober.probe(r, r.deployment, timeout) for r in probing))
        for r, probe in zip(probing, results, strict=True):
            if r.id not in w.stopping:
                self._judge(r, probe, now)

    def _judge(self, r: Replica, probe: Probe, now: float) -> None:
        w = self.w
        rt = w.rt(r.id)
        if probe.ready:
            rt.probe_failures = 0
            if r.state is ReplicaState.STARTING:
                r.state, r.last_ready_at, r.message = ReplicaState.READY, w.clock.time(), ""
                w.store.put_replica(r)
                w.replica_event("ready", r, f"serving on {r.node} cards {list(r.gpus)}")
                if r.replaces:
                    self.x.complete(r)
                else:
                    w.route(r.deployment)
        elif r.state is ReplicaState.STARTING:
            if probe.failed:
                self.x.failed(r, f"model failed to load: {probe.failed}", kill=True)
            elif now - r.started_at > w.settings.startup_timeout_s:
                self.x.failed(r, f"not ready after {w.settings.startup_timeout_s:g} s", kill=True)
        else:
            rt.probe_failures += 1
            if rt.probe_failures >= w.settings.probe_failures_to_fail:
                self.x.failed(r, f"{rt.probe_failures} readiness probes failed", kill=True)

    async def restart(self, r: Replica) -> None:
        """Restart FAILED ``r`` on its slice, or send it back to pending when its slice is gone or unusable."""
        w = self.w
        try:
            d = w.store.get_deployment(r.deployment)
        except NotFoundError:
            return  # an orphan: the next reconcile removes it
        if not r.placed:
            w.to_pending(r, r.message, r.failover)
            return
        state = w.scheduler.state
        i = state.node_index(r.node)
        if not w.holds(r.id) or not all(state.card_usable(i, g) for g in r.gpus):
            w.release(r.id)
            w.to_pending(r, f"card on {r.node} unusable", failover=True)
            w.poke()
            return
        r.restarts += 1
        w.replica_event("restart", r, f"restart #{r.restarts} on {r.node}")
        await self.x.launch(r, d)


def _untold(_handle: str) -> str:
    return ""
