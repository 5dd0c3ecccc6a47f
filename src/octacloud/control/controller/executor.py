"""Carrying out what the controller decided: launch, drain-and-stop, and make-before-break replacement.

Nothing here blocks the event loop the gateway shares: the launcher's ``launch`` and ``stop`` (which may wait for
a process to exit, or on Ray) run in threads, and a replica being stopped is drained in the background.

**Stopping** (:meth:`Executor.retire`): the replica leaves routing at once; the requests it has in flight may
finish (up to ``drain_timeout_s``); then the launcher stops it (SIGTERM, then SIGKILL after ``stop_grace_s``);
only then is its slice released in the scheduler's state, so nothing else is placed on a slice still in use.

**Replacing** (a defragmentation move, or one step of a rolling update): a *surge* replica (``replaces`` names the
old one) is placed and started while the old one keeps serving. Once the surge replica is READY it is routed,
the old one is retired as above, and whatever waited for the old one's slice (``after``) may start. If the surge
replica fails before it is READY, the replacement is rolled back: it is stopped and its slice released; for a
move, the old replica takes its own slice back and what was placed there returns to pending. The old replica
never stops serving before its replacement does.

A replacement in flight is a :class:`~octacloud.control.store.Transition` in the store, stored with its surge
replica and again as it enters each phase (starting → routing → draining → releasing), so that a restarted
controller carries it on or rolls it back (:meth:`Controller.adopt`). The replacement stays pinned until the
replica it replaces is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

from octacloud.control.controller.world import Runtime, World, log
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.launcher import LaunchSpec, ReplicaAddress
from octacloud.control.slices import Slice, slice_environment, thread_budget
from octacloud.control.store import Transition
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Placement
from octacloud.gateway.routing import Endpoint
from octacloud.scheduler.actions.defragment import Move
from octacloud.scheduler.loop import Evict, PassOperation, Start


def new_replica_id(deployment: str) -> str:
    return f"{deployment}-{uuid.uuid4().hex[:6]}"


class Executor:
    def __init__(self, world: World) -> None:
        self.w = world
        self.rollout_backoff: dict[str, float] = {}
        """Deployment → when its rolling update may try again after a replacement failed."""
        self._background: set[asyncio.Task[None]] = set()
        self._homeless: set[str] = set()
        """Replicas whose move failed before what waits for their slice was told (within one ``execute``)."""

    # ---- the loop's operations ---------------------------------------------------------------------------

    async def execute(self, operations: Sequence[PassOperation], deployments: dict[str, Deployment]) -> None:
        """Carry out a pass's operations, in order (the scheduler's state already holds their outcome)."""
        w = self.w
        self._homeless.clear()
        by_id = {r.id: r for r in w.store.replicas()}
        for op in operations:
            if isinstance(op, Evict):
                victim = by_id.get(op.victim.request.name)
                if victim is not None:
                    w.scheduling.preempted(1)
                    w.replica_event("preempted", victim, f"by {op.by}")
                    self.retire(victim, f"preempted by {op.by}", then="pending")
            elif isinstance(op, Move):
                mover = by_id.get(op.request.name)
                if mover is not None and mover.deployment in deployments:
                    await self.start_move(mover, op.destination, deployments[mover.deployment])
            elif isinstance(op, Start):
                r = by_id.get(op.request.name)
                if r is None or r.deployment not in deployments:
                    w.release(op.request.name)
                    continue
                if any(a in self._homeless for a in op.after):  # a move that made its room failed at once
                    w.release(r.id)
                    for a in op.after:
                        self._rehome(a)
                    continue
                p = op.placement
                running = [a for a in op.after if a in w.stopping or (a in by_id and by_id[a].handle)]
                r.node, r.gpus, r.milli_per_gpu, r.message, r.after = p.node, p.gpus, p.milli_per_gpu, "", running
                r.state = ReplicaState.PENDING
                if r.id in w.stopping:  # a victim of this pass placed again: it starts once its old self stopped
                    r.after.append(r.id)
                    r.handle, r.pid, r.host, r.http_port, r.grpc_port, r.metrics_port = "", None, "", None, None, None
                w.store.put_replica(r)
                waits = f" once {', '.join(op.after)} left" if op.after else ""
                w.replica_event("placed", r, f"{p.node} cards {list(p.gpus)} × {p.milli_per_gpu} milli{waits}")
                if self.room_is_free(r):
                    await self.launch(r, deployments[r.deployment])
                else:  # it waits for its slice: its model downloads to the node meanwhile
                    self.prefetch(r.node, *w.template(r, deployments[r.deployment])[:2])

    def prefetch(self, node: str, model: str, version: str) -> None:
        """Ask the launcher (one that can) to fetch ``model`` to ``node`` ahead of a replica; never blocks."""
        prefetch = getattr(self.w.launcher, "prefetch", None)
        if prefetch is not None:
            try:
                prefetch(node, model, version)
            except Exception:  # an optimisation, never a failed pass
                log.exception("prefetch of %s to %s failed", model, node)

    def room_is_free(self, r: Replica) -> bool:
        """True once every replica named in ``r.after`` has stopped (and so left ``r``'s slice)."""
        if not r.after:
            return True
        live = {x.id for x in self.w.store.replicas()}
        return all(a not in live for a in r.after)  # a stop clears its id from ``after``; a gone one counts too

    # ---- launching ---------------------------------------------------------------------------------------

    async def launch(self, r: Replica, d: Deployment) -> None:
        """Start ``r`` on its slice (it is placed and holds the slice in the scheduler's state)."""
        w = self.w
        node = w.nodes[w.scheduler.state.node_index(r.node)]
        s = Slice(r.node, r.gpus, r.milli_per_gpu)
        env = slice_environment(node, s)
        model, version, _octants = w.template(r, d)
        spec = LaunchSpec(r.id, d.spec.name, w.repository / model, version, env, thread_budget(node, s), s)
        r.after = []
        try:
            await w.store.drained()  # what a restart reads is never behind what runs
            launched = await asyncio.to_thread(w.launcher.launch, spec)
        except Exception as exc:  # a launch that fails is a failed replica, never a dead controller
            log.exception("replica %s: launch failed", r.id)
            self.failed(r, f"launch failed: {exc}")
            return
        if not any(x.id == r.id for x in w.store.replicas(r.deployment)):  # removed while it launched
            self.kill(launched.handle)
            return
        r.handle, r.pid, r.host, r.http_port, r.grpc_port, r.metrics_port = launched.handle, None, "", None, None, None
        r.env, r.state, r.started_at, r.message = env, ReplicaState.STARTING, w.clock.monotonic(), ""
        w.runtime[r.id] = Runtime()
        if launched.address is not None:
            self.addressed(r, launched.address)
        else:
            w.store.put_replica(r)

    def addressed(self, r: Replica, address: ReplicaAddress) -> None:
        r.host, r.http_port, r.grpc_port = address.host, address.http_port, address.grpc_port
        r.metrics_port, r.pid = address.metrics_port, address.pid
        self.w.store.put_replica(r)
        if address.note:
            self.w.replica_event("started", r, address.note)

    def failed(self, r: Replica, why: str, *, kill: bool = False) -> None:
        """``r`` died or will never be ready: stop routing to it; restart it with back-off, or (a surge replica)
        roll its replacement back. ``kill``: its process may still run and is stopped in the background."""
        w = self.w
        w.unroute(r.id, gone=True)
        if kill and r.handle:
            self.kill(r.handle)
        if r.replaces:
            self.roll_back(r, why)
            return
        delay = min(w.settings.backoff_max_s, w.settings.backoff_base_s * 2 ** min(r.restarts, 16))
        w.rt(r.id).next_restart_at = w.clock.monotonic() + delay
        r.state, r.handle, r.pid, r.message = ReplicaState.FAILED, "", None, why
        w.store.put_replica(r)
        w.replica_event("failed", r, f"{why}; restart in {delay:g} s")
        w.route(r.deployment)

    # ---- stopping ----------------------------------------------------------------------------------------

    def retire(self, r: Replica, why: str, *, then: str = "delete", transition: Transition | None = None) -> None:
        """Drain and stop ``r`` in the background. ``then``: "delete" (release its slice and forget it) or
        "pending" (it was preempted: its slice is already someone else's; it waits to be placed again).
        ``transition``: the replacement that takes over from ``r`` (its phases are recorded as it goes)."""
        w = self.w
        if r.id in w.stopping:
            return
        if transition is not None:
            w.phase(transition, "draining")
        endpoints = w.unroute(r.id)
        if then == "delete":
            self.pin(r.id)  # a replica on its way out is never moved
            r.state = ReplicaState.STOPPING
            w.store.put_replica(r)
        tenant = self._tenant(r.deployment)
        w.replica_event("stopping", r, why, tenant)
        r = dataclasses.replace(r, after=list(r.after))  # what runs now; the caller may re-place the record
        job = self._drain_and_stop(r, endpoints, why, then, tenant, transition)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the cloud's loop (a script, a test): stop it here and now
            asyncio.run(job)
            return
        w.stopping[r.id] = loop.create_task(job)

    def _tenant(self, deployment: str) -> str:
        try:
            return self.w.store.get_deployment(deployment).spec.tenant
        except NotFoundError:
            return ""

    async def _drain_and_stop(
        self, r: Replica, endpoints: list[Endpoint], why: str, then: str, tenant: str, t: Transition | None
    ) -> None:
        w = self.w
        try:
            deadline = w.clock.monotonic() + w.settings.drain_timeout_s
            while any(e.outstanding > 0 for e in endpoints) and w.clock.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if r.handle:
                await w.store.drained()
                await self._stop_handle(r.handle, w.settings.stop_grace_s)
        finally:
            w.stopping.pop(r.id, None)
            w.runtime.pop(r.id, None)
        try:
            if t is not None:
                w.phase(t, "releasing")
            if then == "delete":
                self.release_stopped(r, t)
            else:
                fresh = next((x for x in w.store.replicas(r.deployment) if x.id == r.id), None)
                if fresh is not None and not (fresh.placed and w.holds(r.id)):  # unless placed again meanwhile
                    w.to_pending(fresh, why)
                self._free_waiters(r.id)
            w.replica_event("stopped", r, why, tenant)
        except Exception:  # the store failed: the next reconcile finds the replica STOPPING and finishes the job
            log.exception("replica %s: stopped, but recording it failed", r.id)
        if then == "pending":
            w.poke()  # it waits to be placed again (what waited for its slice starts at the next health tick)

    def release_stopped(self, r: Replica, t: Transition | None = None) -> None:
        """``r`` has stopped: release its slice, forget it, let what waited for its slice start, and end the
        replacement ``t`` that took over from it (its replacement becomes movable again)."""
        w = self.w
        w.release(r.id)
        w.store.delete_replica(r.id)
        self._free_waiters(r.id)
        if r.id in w.transitions:  # a replacement stopped before it took over (its deployment was removed)
            w.end_transition(r.id)
        if t is not None:
            w.end_transition(t.replacement)
            self.pin(t.replacement, pinned=False)

    def _free_waiters(self, stopped: str) -> None:
        """``stopped`` left its slice: what waited for it may start."""
        for waiter in self.w.store.replicas():
            if stopped in waiter.after:
                waiter.after = [a for a in waiter.after if a != stopped]
                self.w.store.put_replica(waiter)

    async def _stop_handle(self, handle: str, grace: float) -> None:
        try:
            await asyncio.to_thread(self.w.launcher.stop, handle, grace)
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

    async def close(self) -> None:
        """Wait for background stops to finish (the cloud is stopping)."""
        pending = [*self._background, *self.w.stopping.values()]
        if pending:
            await asyncio.wait(pending, timeout=self.w.settings.stop_grace_s + 5.0)

    # ---- make-before-break replacement -------------------------------------------------------------------

    async def start_move(self, mover: Replica, destination: Placement, d: Deployment) -> None:
        """The pass moved ``mover`` to ``destination`` in the state: start its replacement there."""
        w = self.w
        if not mover.handle or mover.state is ReplicaState.STOPPING:  # nothing runs: it just has a new slice
            mover.node, mover.gpus, mover.milli_per_gpu = destination.node, destination.gpus, destination.milli_per_gpu
            w.store.put_replica(mover)
            w.scheduling.moved()
            w.replica_event("moved", mover, f"to {destination.node} cards {list(destination.gpus)} (not running)")
            return
        model, version, octants = w.template(mover, d)
        surge = Replica(
            id=new_replica_id(d.spec.name),
            deployment=d.spec.name,
            node=destination.node,
            gpus=destination.gpus,
            milli_per_gpu=destination.milli_per_gpu,
            model=model,
            version=version,
            octants=octants,
            revision=mover.revision,
            replaces=mover.id,
        )
        t = Transition(surge.id, mover.id, "move", d.spec.name, "starting", destination.node, destination.gpus,
                       destination.milli_per_gpu)  # fmt: skip
        w.release(mover.id)  # the pass's destination becomes the surge replica's; the mover keeps running
        w.scheduler.commit(
            dataclasses.replace(w.request(surge, d), pinned=True),
            Placement(surge.id, destination.node, destination.gpus, destination.milli_per_gpu),
        )
        w.store.begin_replacement(surge, t)  # a restart from here on finds the move and adopts or undoes it
        w.transitions[surge.id] = t
        where = f"{destination.node} cards {list(destination.gpus)}"
        w.replica_event("moving", mover, f"to {where} as {surge.id}: make-before-break")
        await self.launch(surge, d)

    def complete(self, surge: Replica) -> None:
        """``surge`` is READY: route to it, retire the replica it replaces (it stays pinned until that one is
        gone)."""
        w = self.w
        source = surge.replaces or (w.transitions[surge.id].source if surge.id in w.transitions else "")
        old = next((r for r in w.store.replicas(surge.deployment) if r.id == source), None)
        t = w.transitions.get(surge.id)
        if t is None:  # from before replacements were recorded
            t = Transition(surge.id, source, "update" if old is not None and w.holds(old.id) else "move",
                           surge.deployment)  # fmt: skip
        w.phase(t, "routing")
        surge.replaces = ""
        w.store.put_replica(surge)
        w.route(surge.deployment)
        if old is None:
            w.end_transition(surge.id)
            self.pin(surge.id, pinned=False)
            return
        if t.kind == "move":
            w.scheduling.moved()
            w.replica_event("moved", old, f"{old.node} cards {list(old.gpus)} → {surge.id} on {surge.node}")
            self.retire(old, f"moved to {surge.id}", transition=t)
        else:
            w.replica_event("updated", old, f"replaced by {surge.id} (revision {surge.revision})")
            self.retire(old, f"replaced by {surge.id} in a rolling update", transition=t)

    def roll_back(self, surge: Replica, why: str) -> None:
        """``surge`` failed before READY: undo its replacement; the old replica keeps serving."""
        w = self.w
        if surge.handle:
            self.kill(surge.handle)
        w.release(surge.id)
        w.runtime.pop(surge.id, None)
        t = w.transitions.get(surge.id)
        w.store.delete_replica(surge.id)
        w.end_transition(surge.id)
        old = next((r for r in w.store.replicas(surge.deployment) if r.id == surge.replaces), None)
        move = t.kind == "move" if t is not None else old is not None and not w.holds(old.id)
        if old is not None and move and old.placed:  # a move: the old replica takes its slice back
            for waiter in w.store.replicas():
                if old.id in waiter.after:
                    w.release(waiter.id)
                    w.to_pending(waiter, f"the move that made room for it was rolled back: {why}")
            if not self._rehome(old.id):
                self._homeless.add(old.id)  # what the pass placed on its slice is told next, and gives it back
            w.replica_event("move rolled back", old, f"{surge.id} failed ({why}); {old.id} keeps serving")
        else:
            delay = w.settings.backoff_max_s
            self.rollout_backoff[surge.deployment] = w.clock.monotonic() + delay
            w.event("rollout failed", surge.id, f"{why}; the old replica keeps serving; retry in {delay:g} s",
                    surge.deployment)  # fmt: skip
        w.poke()

    def _rehome(self, replica_id: str) -> bool:
        """Give a replica whose move failed its own slice back in the scheduler's state; False if it is taken."""
        w = self.w
        old = next((r for r in w.store.replicas() if r.id == replica_id), None)
        if old is None or w.holds(old.id):
            self._homeless.discard(replica_id)
            return True
        try:
            w.scheduler.commit(w.request(old, w.store.get_deployment(old.deployment)), w.placement(old))
        except (InvalidSpecError, NotFoundError) as exc:
            log.info("replica %s: its slice is still taken after a failed move (%s)", old.id, exc)
            return False
        self._homeless.discard(replica_id)
        return True

    def pin(self, replica_id: str, pinned: bool = True) -> None:
        """Re-account ``replica_id``'s slice as (un)movable by defragmentation (same slice, same size)."""
        a = self.w.allocation(replica_id)
        if a is None or a.request.pinned is pinned:
            return
        self.w.scheduler.release(replica_id)
        with contextlib.suppress(InvalidSpecError):
            self.w.scheduler.commit(dataclasses.replace(a.request, pinned=pinned), a.placement)
