"""The controller: reconciles desired deployments with running replicas.

Every ``interval`` seconds (5 by default, and at once after a change) it:

1. checks replicas: a dead process or a failed readiness probe marks the replica FAILED and the gateway
   stops routing to it at once; FAILED replicas restart on their slice with exponential back-off, or are
   re-placed (using the failover headroom) when their node or card failed;
2. places PENDING replicas through the scheduler, preempting lower-priority replicas when a higher-priority
   one fits nowhere (the victims go back to PENDING and return when room does);
3. adds or removes replicas to match each deployment's desired count (the autoscaler moves it within
   min..max from the load the gateway measured).

Launching and probing are I/O behind small interfaces (:class:`ReplicaLauncher`, :class:`Prober`); time
comes from the injected clock, so the loop is testable without processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from octacloud.cluster.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.cluster.gateway.routing import Endpoint, Owner, RouteTable
from octacloud.cluster.launcher import LaunchFailedError, LaunchSpec, ReplicaAddress, ReplicaLauncher, check_version
from octacloud.cluster.sizing import (
    Autoscaler,
    FleetCapacity,
    LoadSample,
    ModelFootprint,
    Sizing,
    plan_size,
    reserve_percent,
)
from octacloud.cluster.slices import Slice, slice_environment, thread_budget
from octacloud.cluster.store import StateStore
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.observability.scheduling import Outcome, SchedulingStats
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState

log = logging.getLogger("octacloud.controller")

Preemptor = Callable[[Request], list[str] | None]
"""Given an unplaceable request: evict lower-priority requests and place it, returning the victims' names;
or return None (and change nothing) when no set of victims makes it fit."""

FootprintSource = Callable[[str], ModelFootprint]
"""Model name → its footprint (from the repository's config parameters and profile)."""


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What a fleet watcher saw: a node joined or came back (HEALTHY), or was lost (FAILED)."""

    node: Node
    health: Health


class Prober(Protocol):
    """Readiness of a replica's model. Must return within ``timeout`` seconds and never raise."""

    async def ready(self, replica: Replica, model: str, timeout: float) -> bool: ...


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


@dataclass(slots=True)
class _Runtime:
    """Per-replica bookkeeping that need not survive a controller restart."""

    probe_failures: int = 0
    next_restart_at: float = 0.0


@dataclass(slots=True)
class _Load:
    at: float = 0.0
    requests: int = 0
    latency_us: int = 0


@dataclass
class Controller:
    store: StateStore
    nodes: list[Node]
    scheduler: Scheduler
    launcher: ReplicaLauncher
    repository: Path
    routes: RouteTable
    clock: Clock
    prober: Prober
    footprint: FootprintSource
    preemptor: Preemptor | None = None
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    scheduling: SchedulingStats = field(default_factory=SchedulingStats)
    """Decisions, their latency and preemptions, for the cloud's metrics."""
    _runtime: dict[str, _Runtime] = field(default_factory=dict)
    _load: dict[str, _Load] = field(default_factory=dict)
    _wake: asyncio.Event | None = None
    _lock: asyncio.Lock | None = None

    # ---- the operator's API ----------------------------------------------------------------------------

    def deploy(self, spec: DeploymentSpec) -> Deployment:
        """Create or update a deployment. Validates against the repository and the fleet before accepting."""
        if not (self.repository / spec.model).is_dir():
            raise NotFoundError(f"model {spec.model!r} is not in the repository {self.repository}")
        check_version(self.repository / spec.model, spec.version)
        sizing = self.sizing(spec)
        octants, replicas = sizing.octants, sizing.replicas
        try:
            old = self.store.get_deployment(spec.name)
        except NotFoundError:
            d = Deployment(spec, replicas, octants, created_at=self.clock.time())
        else:
            if old.spec.tenant != spec.tenant:
                raise InvalidSpecError(f"deployment {spec.name!r} belongs to another tenant")
            d = Deployment(spec, replicas, octants, old.created_at, old.generation + 1)
            if old.octants != octants or old.spec.model != spec.model or old.spec.version != spec.version:
                for r in self.store.replicas(spec.name):  # replaced by the next reconcile
                    self._stop_replica(r, "redeployed with a new model, version or size")
                    self.store.delete_replica(r.id)
        self.store.put_deployment(d)
        self.routes.owners[spec.name] = Owner(spec.tenant, spec.published)
        self.store.add_event(
            "deploy",
            spec.name,
            f"{spec.model} × {replicas} on {octants} octant(s)" + (f": {sizing.reason}" if sizing.reason else ""),
        )
        self.poke()
        return d

    def resolve_size(self, spec: DeploymentSpec) -> tuple[int, int]:
        """Octants per replica and replica count ``spec`` resolves to (auto-sizing done); raises as deploy does."""
        return self._resolve_size(spec)

    def scale(self, name: str, replicas: int) -> Deployment:
        d = self.store.get_deployment(name)
        if not d.spec.min_replicas <= replicas <= d.spec.max_replicas:
            raise InvalidSpecError(
                f"deployment {name!r}: replicas must be within {d.spec.min_replicas}..{d.spec.max_replicas}, "
                f"got {replicas} (change min/max with deploy)"
            )
        try:
            memory = self.footprint(d.spec.model).memory_mib
        except (NotFoundError, InvalidSpecError):
            memory = 0
        self.capacity(d.spec.priority).check(name, d.octants, replicas, memory)
        d.replicas = replicas
        d.generation += 1
        self.store.put_deployment(d)
        self.store.add_event("scale", name, f"{replicas} replica(s)")
        self.poke()
        return d

    def undeploy(self, name: str) -> None:
        self.store.get_deployment(name)
        self.routes.remove(name)
        for r in self.store.replicas(name):
            self._stop_replica(r, "undeployed")
            self.store.delete_replica(r.id)
        self.store.delete_deployment(name)
        self.store.add_event("undeploy", name, "removed")

    def status(self) -> list[tuple[Deployment, list[Replica]]]:
        return [(d, self.store.replicas(d.spec.name)) for d in self.store.deployments()]

    def poke(self) -> None:
        """Reconcile now rather than at the next tick."""
        if self._wake is not None:
            self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------------------

    def adopt(self) -> None:
        """On start: rebuild the scheduler's state from the store, adopting replicas that still run."""
        for d in self.store.deployments():
            self.routes.owners[d.spec.name] = Owner(d.spec.tenant, d.spec.published)
        for r in self.store.replicas():
            if not r.placed:
                continue
            try:
                self.scheduler.commit(self._request(r, self.store.get_deployment(r.deployment)), self._placement(r))
            except (InvalidSpecError, NotFoundError) as exc:
                log.warning("replica %s: cannot re-account its slice (%s); re-placing it", r.id, exc)
                self._to_pending(r, f"slice lost across restart: {exc}")
                continue
            if not r.handle and r.pid is not None:  # stored before launchers had handles: a local PID
                r.handle = str(r.pid)
            if not r.handle or not self.launcher.alive(r.handle):
                r.state, r.handle, r.pid = ReplicaState.FAILED, "", None
                r.message = "not running after controller restart"
                self.store.put_replica(r)
            elif r.state is ReplicaState.READY:
                self._route(r.deployment)

    async def run(self, stop: asyncio.Event) -> None:
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.adopt()
        next_full = 0.0
        while not stop.is_set():
            now = self.clock.monotonic()
            if now >= next_full or self._wake.is_set():
                self._wake.clear()
                await self.reconcile()
                next_full = self.clock.monotonic() + self.settings.interval_s
            else:
                await self.check_health()
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.health_interval_s)
            except TimeoutError:
                pass

    async def reconcile(self) -> None:
        """One full pass: health, restarts, placement, scaling."""
        await self.check_health()
        deployments = {d.spec.name: d for d in self.store.deployments()}
        self._autoscale(deployments)
        for name, d in deployments.items():
            replicas = self.store.replicas(name)
            surplus = len(replicas) - d.replicas
            if surplus > 0:  # stop the least useful first: pending, then not ready, then newest
                order = sorted(replicas, key=lambda r: (r.state is ReplicaState.READY, r.placed, r.started_at))
                for r in order[:surplus]:
                    self._stop_replica(r, "scaled down")
                    self.store.delete_replica(r.id)
            for _ in range(-surplus):
                self.store.put_replica(Replica(id=f"{name}-{uuid.uuid4().hex[:6]}", deployment=name))
        for orphan in {r.deployment for r in self.store.replicas()} - set(deployments):
            for r in self.store.replicas(orphan):
                self._stop_replica(r, "deployment removed")
                self.store.delete_replica(r.id)
        by_priority = sorted(deployments.values(), key=lambda d: -d.spec.priority)
        for d in by_priority:
            for r in self.store.replicas(d.spec.name):
                if r.state is ReplicaState.PENDING:
                    self._place_and_launch(r, d)
                elif r.state is ReplicaState.FAILED:
                    self._restart(r, d)
            self._route(d.spec.name)

    async def check_health(self) -> None:
        now = self.clock.monotonic()
        for r in self.store.replicas():
            if r.state not in (ReplicaState.STARTING, ReplicaState.READY) or not r.handle:
                continue
            rt = self._runtime.setdefault(r.id, _Runtime())
            if not self.launcher.alive(r.handle):
                self._failed(r, "process exited")
                continue
            if not r.http_port:  # a remote replica reports where it serves once it has started
                try:
                    address = self.launcher.address(r.handle)
                except LaunchFailedError as exc:
                    self.launcher.stop(r.handle, 0.0)
                    self._failed(r, f"start failed: {exc}")
                    continue
                if address is None:
                    if now - r.started_at > self.settings.startup_timeout_s:
                        self.launcher.stop(r.handle, 0.0)
                        self._failed(r, f"not started after {self.settings.startup_timeout_s:g} s")
                    continue
                self._addressed(r, address)
            ok = await self.prober.ready(r, r.deployment, self.settings.probe_timeout_s)
            if ok:
                rt.probe_failures = 0
                if r.state is ReplicaState.STARTING:
                    r.state, r.last_ready_at, r.message = ReplicaState.READY, self.clock.time(), ""
                    self.store.put_replica(r)
                    self.store.add_event("ready", r.id, f"serving on {r.node} cards {list(r.gpus)}")
                    self._route(r.deployment)
            elif r.state is ReplicaState.STARTING:
                if now - r.started_at > self.settings.startup_timeout_s:
                    self.launcher.stop(r.handle, 0.0)
                    self._failed(r, f"not ready after {self.settings.startup_timeout_s:g} s")
            else:
                rt.probe_failures += 1
                if rt.probe_failures >= self.settings.probe_failures_to_fail:
                    self.launcher.stop(r.handle, self.settings.stop_grace_s)
                    self._failed(r, f"{rt.probe_failures} readiness probes failed")

    def mark_node(self, name: str, health: Health) -> None:
        """A node failed (or recovered): its replicas are re-placed elsewhere on the next pass."""
        self.scheduler.state.set_node_health(name, health)
        self.store.add_event("node", name, health.value)
        if health is Health.FAILED:
            for r in self.store.replicas():
                if r.node == name:
                    self.routes.drop_endpoint(r.id)  # first: the gateway stops routing to it at once
                    if r.handle:
                        self.launcher.stop(r.handle, 0.0)
                    self._release(r)
                    self._to_pending(r, f"node {name} failed", failover=True)
        self.poke()

    def node_changed(self, change: NodeChange) -> None:
        """Apply what a fleet watcher saw: a new node joins the fleet (the scheduler may use it at once), a known
        node that was lost comes back, or a node is lost (its replicas are re-placed on the others)."""
        name = change.node.name
        state = self.scheduler.state
        if change.health is Health.FAILED:
            if name in state.index and state.nodes[state.index[name]].health is not Health.FAILED:
                self.mark_node(name, Health.FAILED)
            return
        if name not in state.index:
            self._grow_fleet(change.node)
            cards = f"{change.node.gpu_count} × {change.node.gpu_model or 'no card'}"
            self.store.add_event("node", name, f"joined: {cards}")
            self.poke()
        elif state.nodes[state.index[name]].health is not Health.HEALTHY:
            self.mark_node(name, Health.HEALTHY)

    def _grow_fleet(self, node: Node) -> None:
        """Rebuild the scheduler's state with ``node`` added, carrying over every allocation and health."""
        old = self.scheduler.state
        healthy = [_all_healthy(n) for n in old.nodes]
        fresh = ClusterState([*healthy, _all_healthy(node)])
        scheduler = Scheduler(fresh, self.scheduler.profile)
        for a in old:
            scheduler.commit(a.request, a.placement)
        for n in [*old.nodes, node]:
            for g in n.gpus:
                if g.health is not Health.HEALTHY:
                    fresh.set_card_health(n.name, g.index, g.health)
            if n.health is not Health.HEALTHY:
                fresh.set_node_health(n.name, n.health)
        self.scheduler = scheduler
        self.nodes.append(node)

    # ---- mechanism ---------------------------------------------------------------------------------------

    def _resolve_size(self, spec: DeploymentSpec) -> tuple[int, int]:
        sizing = self.sizing(spec)
        return sizing.octants, sizing.replicas

    def sizing(self, spec: DeploymentSpec) -> Sizing:
        """The size ``spec`` resolves to and why; raises when it could never be placed on this fleet."""
        return plan_size(spec, lambda: self.footprint(spec.model), self.capacity(spec.priority))

    def capacity(self, priority: int = 0) -> FleetCapacity:
        """What the fleet could ever give a deployment of ``priority`` (the failover reserve kept from it)."""
        return FleetCapacity.of(self.nodes, reserve_percent(self.scheduler.profile, priority))

    def _request(self, r: Replica, d: Deployment, failover: bool = False) -> Request:
        octants = d.octants
        whole = octants >= OCTANTS_PER_GPU
        try:
            memory = self.footprint(d.spec.model).memory_mib
        except (NotFoundError, InvalidSpecError):
            memory = 0
        return Request(
            name=r.id,
            num_gpu=octants // OCTANTS_PER_GPU if whole else 1,
            gpu_milli=MILLI_PER_GPU if whole else octants * MILLI_PER_OCTANT,
            gpu_memory_mib=memory,
            priority=d.spec.priority,
            owner=d.spec.tenant,
            failover=failover,
        )

    @staticmethod
    def _placement(r: Replica) -> Placement:
        return Placement(r.id, r.node, r.gpus, r.milli_per_gpu)

    def _place_and_launch(self, r: Replica, d: Deployment) -> None:
        request = self._request(r, d, failover=r.message.startswith("failover:"))
        started = time.perf_counter()
        decision = self.scheduler.schedule(request)
        outcome = Outcome.PLACED if decision.placement is not None else Outcome.UNSCHEDULABLE
        if decision.placement is None and self.preemptor is not None:
            victims = self.preemptor(request)
            if victims is not None:
                outcome = Outcome.PREEMPTED
                self.scheduling.preempted(len(victims))
                for victim in victims:
                    self._preempted(victim, r.id)
                decision.placement = self.scheduler.state.allocations[r.id].placement
        self.scheduling.decision(outcome, time.perf_counter() - started)
        if decision.placement is None:
            why = decision.explain()
            if r.message != why:
                r.message = why
                self.store.put_replica(r)
                self.store.add_event("unschedulable", r.id, why)
            return
        p = decision.placement
        r.node, r.gpus, r.milli_per_gpu, r.message = p.node, p.gpus, p.milli_per_gpu, ""
        self.store.add_event("placed", r.id, f"{p.node} cards {list(p.gpus)} × {p.milli_per_gpu} milli")
        self._launch(r, d)

    def _launch(self, r: Replica, d: Deployment) -> None:
        node = self.nodes[self.scheduler.state.node_index(r.node)]
        s = Slice(r.node, r.gpus, r.milli_per_gpu)
        env = slice_environment(node, s)
        spec = LaunchSpec(
            r.id, d.spec.name, self.repository / d.spec.model, d.spec.version, env, thread_budget(node, s), s
        )
        try:
            launched = self.launcher.launch(spec)
        except Exception as exc:  # a launch that fails is a failed replica, never a dead controller
            log.exception("replica %s: launch failed", r.id)
            self._failed(r, f"launch failed: {exc}")
            return
        r.handle, r.pid, r.host, r.http_port, r.grpc_port, r.metrics_port = launched.handle, None, "", None, None, None
        r.env, r.state, r.started_at = env, ReplicaState.STARTING, self.clock.monotonic()
        if launched.address is not None:
            self._addressed(r, launched.address)
        else:
            self.store.put_replica(r)
        self._runtime[r.id] = _Runtime()

    def _addressed(self, r: Replica, address: ReplicaAddress) -> None:
        r.host, r.http_port, r.grpc_port = address.host, address.http_port, address.grpc_port
        r.metrics_port, r.pid = address.metrics_port, address.pid
        self.store.put_replica(r)
        if address.note:
            self.store.add_event("started", r.id, address.note)

    def _restart(self, r: Replica, d: Deployment) -> None:
        rt = self._runtime.setdefault(r.id, _Runtime())
        if self.clock.monotonic() < rt.next_restart_at:
            return
        if not r.placed:
            r.state = ReplicaState.PENDING
            self._place_and_launch(r, d)
            return
        i = self.scheduler.state.node_index(r.node)
        if not all(self.scheduler.state.card_usable(i, g) for g in r.gpus):
            self._release(r)
            self._to_pending(r, f"card on {r.node} unusable", failover=True)
            self._place_and_launch(r, d)
            return
        r.restarts += 1
        self.store.add_event("restart", r.id, f"restart #{r.restarts} on {r.node}")
        self._launch(r, d)

    def _failed(self, r: Replica, why: str) -> None:
        self.routes.drop_endpoint(r.id)
        rt = self._runtime.setdefault(r.id, _Runtime())
        delay = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** min(r.restarts, 16))
        rt.next_restart_at = self.clock.monotonic() + delay
        r.state, r.handle, r.pid, r.message = ReplicaState.FAILED, "", None, why
        self.store.put_replica(r)
        self.store.add_event("failed", r.id, why)
        self.poke()

    def _preempted(self, victim: str, by: str) -> None:
        for r in self.store.replicas():
            if r.id == victim:
                self.routes.drop_endpoint(r.id)
                if r.handle:
                    self.launcher.stop(r.handle, self.settings.stop_grace_s)
                self._to_pending(r, f"preempted by {by}")
                self.store.add_event("preempted", r.id, f"by {by}")

    def _to_pending(self, r: Replica, why: str, failover: bool = False) -> None:
        r.node, r.gpus, r.milli_per_gpu, r.handle, r.pid = "", (), 0, "", None
        r.state, r.message = ReplicaState.PENDING, ("failover: " if failover else "") + why
        self.store.put_replica(r)

    def _release(self, r: Replica) -> None:
        if r.id in self.scheduler.state.allocations:
            self.scheduler.state.release(r.id)

    def _stop_replica(self, r: Replica, why: str) -> None:
        self.routes.drop_endpoint(r.id)
        if r.handle:
            self.launcher.stop(r.handle, self.settings.stop_grace_s)
        self._release(r)
        self._runtime.pop(r.id, None)
        self.store.add_event("stopped", r.id, why)
        r.state, r.handle, r.pid = ReplicaState.STOPPING, "", None

    def _route(self, deployment: str) -> None:
        ready = [
            Endpoint(r.id, r.host or "127.0.0.1", r.http_port or 0, r.grpc_port or 0)
            for r in self.store.replicas(deployment)
            if r.state is ReplicaState.READY and r.http_port
        ]
        self.routes.update(deployment, ready)

    def _autoscale(self, deployments: dict[str, Deployment]) -> None:
        now = self.clock.monotonic()
        for name, d in deployments.items():
            if d.spec.min_replicas == d.spec.max_replicas or d.spec.target_qps is None:
                continue
            c = self.routes.counter(name)
            last = self._load.get(name)
            self._load[name] = _Load(now, c.requests, c.latency_us_total)
            if last is None or now <= last.at:
                continue
            n = c.requests - last.requests
            sample = LoadSample(
                qps=n / (now - last.at),
                outstanding=float(c.outstanding),
                mean_latency_ms=(c.latency_us_total - last.latency_us) / 1000 / n if n else 0.0,
            )
            capacity = d.spec.target_qps / max(1, d.spec.min_replicas)
            try:
                per_card = self.footprint(d.spec.model).samples_per_second_per_card
            except (NotFoundError, InvalidSpecError):
                per_card = None
            if per_card:
                capacity = per_card * d.octants / OCTANTS_PER_GPU
            current = len([r for r in self.store.replicas(name) if r.state is ReplicaState.READY]) or d.replicas
            wanted = self.autoscaler.desired(
                name,
                now,
                current,
                sample,
                capacity_qps=capacity,
                slo_ms=d.spec.slo_ms,
                min_replicas=d.spec.min_replicas,
                max_replicas=d.spec.max_replicas,
            )
            if wanted != d.replicas and not math.isnan(sample.qps):
                self.store.add_event("autoscale", name, f"{d.replicas} → {wanted} at {sample.qps:.1f} req/s")
                d.replicas = wanted
                self.store.put_deployment(d)


def _all_healthy(node: Node) -> Node:
    gpus = tuple(dataclasses.replace(g, health=Health.HEALTHY) for g in node.gpus)
    return dataclasses.replace(node, gpus=gpus, health=Health.HEALTHY)
