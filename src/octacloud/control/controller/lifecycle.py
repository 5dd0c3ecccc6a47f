"""Starting replicas, routing to them, and stopping them: the mechanism every other part of the controller uses.

Nothing here blocks the event loop the gateway shares: the launcher's ``launch`` and ``stop`` (which may wait for
a process to exit, or on Ray) run in threads, and a replica being stopped is drained in the background. Before a
process is started or stopped, the store's queued writes are stored (what a restart reads is never behind what
runs).

**Routing**: a deployment is routed to its READY replicas that are not being stopped.

**Stopping** (:meth:`Lifecycle.retire`): the replica leaves routing at once; the requests it has in flight may
finish (up to ``drain_timeout_s``); then the launcher stops it (SIGTERM, then SIGKILL after ``stop_grace_s``);
only then is its slice released in the scheduler's state, so nothing else is placed on a slice still in use.
Whoever retires a replica may ask to be told once it has stopped (a replacement releases its source so).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octacloud.control.controller.contracts import ControllerSettings, Wakeup, log
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.launcher import LaunchSpec, ReplicaAddress, ReplicaLauncher
from octacloud.control.slices import Slice, slice_environment, thread_budget
from octacloud.core.clock import Clock
from octacloud.gateway.routing import Endpoint, RouteTable

LAUNCHES_AT_ONCE = 8
"""Launches in flight at once, each in a thread of the controller's own (the event loop's default pool is a few
threads, shared with everything else that waits off the loop): one after another, a fleet's deploy waits for each
launch's store flush and its launcher's answer in turn."""

Stopped = Callable[[Replica], None]
"""Told that a retired replica has stopped (its process exited; its record and slice are the handler's)."""


@dataclass(slots=True)
class _Stop:
    then: str
    handlers: list[Stopped] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class Lifecycle:
    def __init__(
        self,
        *,
        store: ControllerStore,
        launcher: ReplicaLauncher,
        routes: RouteTable,
        reservations: Reservations,
        events: EventLog,
        clock: Clock,
        settings: ControllerSettings,
        repository: Path,
        wakeup: Wakeup,
    ) -> None:
        self.store, self.launcher, self.routes = store, launcher, routes
        self.reservations, self.events, self.clock = reservations, events, clock
        self.settings, self.repository, self.wakeup = settings, repository, wakeup
        self._stopping: dict[str, _Stop] = {}
        """Replicas being drained and stopped in the background, by id."""
        self._background: set[asyncio.Task[None]] = set()
        self._launching: ThreadPoolExecutor | None = None

    # ---- routing -----------------------------------------------------------------------------------------

    def route(self, deployment: str) -> None:
        """Route ``deployment`` to its READY replicas (those being stopped are out already)."""
        ready = [
            Endpoint(r.id, r.host or "127.0.0.1", r.http_port or 0, r.grpc_port or 0)
            for r in self.store.peek_replicas(deployment)  # (read only: a copy each would cost what it has)
            if r.state is ReplicaState.READY and r.http_port and r.id not in self._stopping
        ]
        self.routes.update(deployment, sorted(ready, key=lambda e: e.replica_id))

    def unroute(self, replica_id: str, gone: bool = False) -> list[Endpoint]:
        """Stop routing new requests to ``replica_id`` at once; returns its endpoints (to watch them drain).
        ``gone``: it died, so the gateway ends what it has in flight there at once (to retry it elsewhere)."""
        found = [e for endpoints in self.routes.routes.values() for e in endpoints if e.replica_id == replica_id]
        self.routes.drop_endpoint(replica_id, gone=gone)
        return found

    # ---- starting ----------------------------------------------------------------------------------------

    def runs(self, r: Replica | None) -> bool:
        """Whether ``r``'s process runs (as far as its launcher can tell)."""
        return r is not None and bool(r.handle) and self.launcher.alive(r.handle)

    def room_is_free(self, r: Replica) -> bool:
        """True once every replica named in ``r.after`` has stopped (and so left ``r``'s slice)."""
        # a stop clears its id from ``after``; a gone one counts too
        return not any(self.store.has_replica(a) for a in r.after)

    async def launch(self, r: Replica, d: Deployment) -> str:
        """Start ``r`` on its slice (it is placed and holds the slice in the scheduler's state). Returns '' or why
        the launch failed: the caller fails the replica (a launch that fails never kills the controller)."""
        node = self.reservations.node(r.node)
        s = Slice(r.node, r.gpus, r.milli_per_gpu)
        env = slice_environment(node, s)
        model, version, _octants = r.runs(d)
        spec = LaunchSpec(r.id, d.spec.name, self.repository / model, version, env, thread_budget(node, s), s)
        r.after = []
        try:
            await self.store.drained()  # what a restart reads is never behind what runs
            launched = await asyncio.get_running_loop().run_in_executor(
                self._launch_threads(), self.launcher.launch, spec
            )
        except Exception as exc:
            log.exception("replica %s: launch failed", r.id)
            return f"launch failed: {exc}"
        if not self.store.has_replica(r.id):  # removed while it launched
            self.kill(launched.handle)
            return ""
        r.handle, r.pid, r.host, r.http_port, r.grpc_port, r.metrics_port = launched.handle, None, "", None, None, None
        r.env, r.state, r.started_at, r.message = env, ReplicaState.STARTING, self.clock.monotonic(), ""
        if launched.address is not None:
            self.addressed(r, launched.address)
        else:
            self.store.put_replica(r)
        return ""

    def _launch_threads(self) -> ThreadPoolExecutor:
        if self._launching is None:
            self._launching = ThreadPoolExecutor(LAUNCHES_AT_ONCE, thread_name_prefix="octacloud-launch")
        return self._launching

    def prefetch(self, node: str, model: str, version: str) -> None:
        """Ask the launcher (one that can) to fetch ``model`` to ``node`` ahead of a replica; never blocks."""
        prefetch = getattr(self.launcher, "prefetch", None)
        if prefetch is not None:
            try:
                prefetch(node, model, version)
            except Exception:  # an optimisation, never a failed pass
                log.exception("prefetch of %s to %s failed", model, node)

    def exit_reason(self, handle: str) -> str:
        """Why ``handle``'s process exited, when its launcher can tell ('' otherwise)."""
        reason = getattr(self.launcher, "exit_reason", None)
        return reason(handle) if reason is not None else ""

    def addressed(self, r: Replica, address: ReplicaAddress) -> None:
        """``r`` reported where it serves."""
        r.host, r.http_port, r.grpc_port = address.host, address.http_port, address.grpc_port
        r.metrics_port, r.pid = address.metrics_port, address.pid
        self.store.put_replica(r)
        if address.note:
            self.events.replica("started", r, address.note)

    # ---- stopping ----------------------------------------------------------------------------------------

    def is_stopping(self, replica_id: str) -> bool:
        return replica_id in self._stopping

    def retire(self, r: Replica, why: str, *, then: str = "delete", on_stopped: Stopped | None = None) -> None:
        """Drain and stop ``r`` in the background. ``then``: "delete" (release its slice and forget it) or
        "pending" (it was preempted: its slice is already someone else's; it waits to be placed again).
        ``on_stopped``: told once it has stopped, instead of ``then`` (also when it was being stopped already)."""
        stop = self._stopping.get(r.id)
        if stop is not None:
            if on_stopped is not None:
                stop.handlers.append(on_stopped)
            return
        stop = _Stop(then, [on_stopped] if on_stopped is not None else [])
        endpoints = self.unroute(r.id)
        if then == "delete":
            self.reservations.pin(r.id)  # a replica on its way out is never moved
            r.state = ReplicaState.STOPPING
            self.store.put_replica(r)
        tenant = self.events.tenant(r.deployment)
        self.events.replica("stopping", r, why, tenant)
        r = dataclasses.replace(r, after=list(r.after))  # what runs now; the caller may re-place the record
        job = self._drain_and_stop(r, endpoints, why, tenant, stop)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the cloud's loop (a script, a test): stop it here and now
            asyncio.run(job)
            return
        stop.task = loop.create_task(job)
        self._stopping[r.id] = stop

    async def _drain_and_stop(self, r: Replica, endpoints: list[Endpoint], why: str, tenant: str, stop: _Stop) -> None:
        try:
            deadline = self.clock.monotonic() + self.settings.drain_timeout_s
            while any(e.outstanding > 0 for e in endpoints) and self.clock.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if r.handle:
                await self.store.drained()
                await self._stop_handle(r.handle, self.settings.stop_grace_s)
        finally:
            self._stopping.pop(r.id, None)
        try:
            if stop.handlers:
                for handler in stop.handlers:
                    handler(r)
            elif stop.then == "delete":
                self.release_stopped(r)
            else:
                fresh = next((x for x in self.store.replicas(r.deployment) if x.id == r.id), None)
                if fresh is not None and not (fresh.placed and self.reservations.holds(r.id)):  # unless placed again
                    fresh.unplace(why)
                    self.store.put_replica(fresh)
                self.free_waiters(r.id)
            self.events.replica("stopped", r, why, tenant)
        except Exception:  # the store failed: the next reconcile finds the replica STOPPING and finishes the job
            log.exception("replica %s: stopped, but recording it failed", r.id)
        if stop.then == "pending":
            self.wakeup.poke()  # it waits to be placed again (what waited for its slice starts at the next tick)

    def release_stopped(self, r: Replica) -> None:
        """``r`` has stopped: release its slice, forget it (and a replacement it was the surge replica of), and
        let what waited for its slice start."""
        self.reservations.release(r.id)
        self.store.delete_replica(r.id)
        self.free_waiters(r.id)

    def free_waiters(self, stopped: str) -> None:
        """``stopped`` left its slice: what waited for it may start."""
        for waiter in self.store.waiting_for(stopped):
            waiter.after = [a for a in waiter.after if a != stopped]
            self.store.put_replica(waiter)

    async def _stop_handle(self, handle: str, grace: float) -> None:
        try:
            await asyncio.to_thread(self.launcher.stop, handle, grace)
        except Exception:
            log.exception("stopping replica %s failed", handle)

    def kill(self, handle: str) -> None:
        """Stop a replica's process without a grace period, in the background."""
        self._spawn(self._stop_handle(handle, 0.0))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(coro)
            return
        task = loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def in_progress(self) -> list[asyncio.Task[None]]:
        """The stops still running in the background."""
        return [*self._background, *(s.task for s in self._stopping.values() if s.task is not None)]

    async def close(self) -> None:
        """Wait for background stops to finish (the cloud is stopping)."""
        pending = self.in_progress()
        if pending:
            await asyncio.wait(pending, timeout=self.settings.stop_grace_s + 5.0)
        if self._launching is not None:
            self._launching.shutdown(wait=False)
            self._launching = None
