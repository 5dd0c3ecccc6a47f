"""What every part of the controller shares: its settings, its seams (store, launcher, prober, clock, routes) and
the bookkeeping that need not survive a restart, with the few helpers they all use (events, requests, routing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.launcher import ReplicaLauncher
from octacloud.control.sizing import ModelFootprint
from octacloud.control.store import Transition
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.gateway.routing import Endpoint, RouteTable
from octacloud.observability.scheduling import SchedulingStats
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import Allocation

log = logging.getLogger("octacloud.controller")

FootprintSource = Callable[[str], ModelFootprint]
"""Model name → its footprint (from the repository's config parameters and profile)."""


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What a fleet watcher saw: a node joined or came back (HEALTHY), or was lost (FAILED)."""

    node: Node
    health: Health


@dataclass(frozen=True, slots=True)
class Probe:
    """A readiness probe's answer: ready, not (yet) ready, or failed for good (``failed`` says why)."""

    ready: bool
    failed: str = ""


class Prober(Protocol):
    """Readiness of a replica's model. Must return within ``timeout`` seconds and never raise. ``failed`` is set
    only when the replica can never become ready as it is (its model failed to load)."""

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe: ...


@dataclass(slots=True)
class ControllerSettings:
    interval_s: float = 5.0
    health_interval_s: float = 0.5
    startup_timeout_s: float = 120.0
    probe_timeout_s: float = 2.0
    probe_failures_to_fail: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    stop_grace_s: float = 5.0
    """After SIGTERM (a graceful stop), how long a replica has before it is killed."""
    drain_timeout_s: float = 30.0
    """How long a replica taken out of routing may finish the requests it has before it is stopped anyway."""
    stall_after_s: float = 30.0
    """Readiness fails when the controller's loop has not completed an iteration for this long."""


@dataclass(slots=True)
class Runtime:
    """Per-replica bookkeeping that need not survive a controller restart."""

    probe_failures: int = 0
    next_restart_at: float = 0.0


@dataclass
class World:
    """The controller's dependencies and shared bookkeeping. Only the controller's event loop touches it."""

    store: ControllerStore
    nodes: list[Node]
    scheduler: Scheduler
    launcher: ReplicaLauncher
    repository: Path
    routes: RouteTable
    clock: Clock
    prober: Prober
    footprint: FootprintSource
    settings: ControllerSettings
    scheduling: SchedulingStats
    runtime: dict[str, Runtime] = field(default_factory=dict)
    stopping: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    """Replicas being drained and stopped in the background, by id."""
    wake: asyncio.Event | None = None
    waiting: int = 0
    """Replicas the latest pass left pending: while there are any, a released slice wakes the controller, so the
    queue gets it at once (as a scheduler's queue is retried when a pod is deleted), not at the next tick."""
    transitions: dict[str, Transition] = field(default_factory=dict)
    """Replacements in flight by replacement replica id (a mirror of the store's, which survive a restart)."""

    def poke(self) -> None:
        """Reconcile now rather than at the next tick."""
        if self.wake is not None:
            self.wake.set()

    def rt(self, replica_id: str) -> Runtime:
        return self.runtime.setdefault(replica_id, Runtime())

    # ---- replacements in flight ------------------------------------------------------------------------

    def phase(self, t: Transition, phase: str) -> None:
        """Record that replacement ``t`` enters ``phase`` (stored first: a restart carries on from there)."""
        self.store.put_transition(Transition(t.replacement, t.source, t.kind, t.deployment, phase, t.node, t.gpus,
                                             t.milli_per_gpu))  # fmt: skip
        t.phase = phase
        self.transitions[t.replacement] = t

    def end_transition(self, replacement: str) -> None:
        self.store.delete_transition(replacement)
        self.transitions.pop(replacement, None)

    # ---- events ------------------------------------------------------------------------------------------

    def event(self, kind: str, subject: str, message: str, deployment: str = "") -> None:
        """Record an event about ``subject`` for ``deployment`` (its tenant is looked up; '' for the fleet's)."""
        tenant = ""
        if deployment:
            try:
                tenant = self.store.get_deployment(deployment).spec.tenant
            except NotFoundError:
                pass
        self.store.add_event(kind, subject, message, deployment=deployment, tenant=tenant)

    def replica_event(self, kind: str, r: Replica, message: str, tenant: str = "") -> None:
        if tenant:
            self.store.add_event(kind, r.id, message, deployment=r.deployment, tenant=tenant)
        else:
            self.event(kind, r.id, message, r.deployment)

    # ---- accounting --------------------------------------------------------------------------------------

    def template(self, r: Replica, d: Deployment) -> tuple[str, str, int]:
        """What ``r`` runs: its own template, or (for a replica from before templates) its deployment's."""
        return r.template() if r.octants else d.template()

    def request(self, r: Replica, d: Deployment) -> Request:
        """The scheduler's request for replica ``r`` (sized by its own template). A surge replica and one being
        stopped are pinned, and so is a replacement until the replica it replaces is gone: defragmentation never
        moves them."""
        model, _version, octants = self.template(r, d)
        whole = octants >= OCTANTS_PER_GPU
        try:
            memory = self.footprint(model).memory_mib
        except (NotFoundError, InvalidSpecError):
            memory = 0
        return Request(
            name=r.id,
            num_gpu=octants // OCTANTS_PER_GPU if whole else 1,
            gpu_milli=MILLI_PER_GPU if whole else octants * MILLI_PER_OCTANT,
            gpu_memory_mib=memory,
            priority=d.spec.priority,
            owner=d.spec.tenant,
            pinned=bool(r.replaces) or r.state is ReplicaState.STOPPING or r.id in self.transitions,
            failover=r.failover,
            model=model,
            group=d.spec.name,
            spread=d.spec.spread,
        )

    @staticmethod
    def placement(r: Replica) -> Placement:
        return Placement(r.id, r.node, r.gpus, r.milli_per_gpu)

    def release(self, replica_id: str) -> None:
        """Give back the slice ``replica_id`` holds in the scheduler's state, if it holds one."""
        if self.holds(replica_id):
            self.scheduler.release(replica_id)
            if self.waiting:
                self.poke()

    def holds(self, replica_id: str) -> bool:
        return self.allocation(replica_id) is not None

    def allocation(self, replica_id: str) -> Allocation | None:
        """What ``replica_id`` holds in the scheduler's state (None: nothing)."""
        return self.scheduler.state.allocations.get(replica_id)

    def to_pending(self, r: Replica, why: str, failover: bool = False) -> None:
        r.node, r.gpus, r.milli_per_gpu, r.handle, r.pid = "", (), 0, "", None
        r.host, r.http_port, r.grpc_port, r.metrics_port = "", None, None, None
        r.state, r.message, r.failover, r.after = ReplicaState.PENDING, why, failover, []
        self.store.put_replica(r)

    # ---- routing -----------------------------------------------------------------------------------------

    def route(self, deployment: str) -> None:
        """Route ``deployment`` to its READY replicas (those being stopped are out already)."""
        ready = [
            Endpoint(r.id, r.host or "127.0.0.1", r.http_port or 0, r.grpc_port or 0)
            for r in self.store.replicas(deployment)
            if r.state is ReplicaState.READY and r.http_port and r.id not in self.stopping
        ]
        self.routes.update(deployment, ready)

    def unroute(self, replica_id: str, gone: bool = False) -> list[Endpoint]:
        """Stop routing new requests to ``replica_id`` at once; returns its endpoints (to watch them drain).
        ``gone``: it died, so the gateway ends what it has in flight there at once (to retry it elsewhere)."""
        found = [e for endpoints in self.routes.routes.values() for e in endpoints if e.replica_id == replica_id]
        self.routes.drop_endpoint(replica_id, gone=gone)
        return found
