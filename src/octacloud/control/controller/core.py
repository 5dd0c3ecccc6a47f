"""The controller: the operator's API (deploy, scale, undeploy, rollouts, the fleet's news) and the loop that
drives the parts.

Every ``health_interval_s`` it checks health (:mod:`.health`); every ``interval_s`` (and at once after a change)
it reconciles (:mod:`.reconcile`), whose placement step is the scheduler's own re-evaluation loop carried out by
:mod:`.executor`; replacements have one owner (:mod:`.replacement`), and nothing blocks the event loop the gateway
shares (:mod:`.lifecycle`).

The loop is level-triggered and never dies of an I/O error: an iteration that fails (the state store is locked
or the disk is full) is logged and retried with back-off, and :meth:`Controller.ready` turns false while the loop
is not running or has not completed an iteration for ``stall_after_s`` — the gateway's readiness reports it.
The store is read from memory and written behind by one thread (:mod:`.state`): a locked database delays the
controller's writes, never the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octacloud.control.controller.adoption import Adoption
from octacloud.control.controller.autoscale import Autoscaling
from octacloud.control.controller.contracts import ControllerSettings, FootprintSource, NodeChange, Prober, Wakeup, log
from octacloud.control.controller.deploys import DeployAdmission, Deployed, Deployer
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.executor import Executor
from octacloud.control.controller.fleet_changes import FleetChanges
from octacloud.control.controller.health import HealthChecker
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.reconcile import Reconciler
from octacloud.control.controller.replacement import Replacements
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.rollouts import rollout_status
from octacloud.control.controller.state import ControllerStore, as_controller_store
from octacloud.control.deploy_request import DeployRequest
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica
from octacloud.control.launcher import ReplicaLauncher
from octacloud.control.sizing import Autoscaler, FleetCapacity, Sizing
from octacloud.control.store import StateStore
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node
from octacloud.gateway.routing import RouteTable
from octacloud.observability.scheduling import SchedulingStats
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.storage.store import FsspecStore, ModelStore


@dataclass(slots=True)
class LoopHealth:
    """Whether the controller's loop runs and completes iterations (what readiness reports)."""

    running: bool = False
    last_ok_at: float = 0.0
    failures: int = 0
    """Iterations in a row that failed."""
    last_error: str = ""


class Controller:
    def __init__(
        self,
        *,
        store: StateStore | ControllerStore,
        nodes: list[Node],
        scheduler: Scheduler,
        launcher: ReplicaLauncher,
        repository: Path,
        routes: RouteTable,
        clock: Clock,
        prober: Prober,
        footprint: FootprintSource,
        settings: ControllerSettings | None = None,
        loop: LoopSettings | None = None,
        autoscaler: Autoscaler | None = None,
        scheduling: SchedulingStats | None = None,
        models: ModelStore | None = None,
        admission: DeployAdmission | None = None,
    ) -> None:
        self.models: ModelStore = models if models is not None else FsspecStore(str(repository))
        """Where configs, versions and sizes are read (``--model-storage``; default: the repository folder)."""
        self.store: ControllerStore = as_controller_store(store, clock)
        """The state store as the controller sees it: read from memory, written behind by one thread."""
        self.launcher, self.repository, self.routes, self.clock = launcher, repository, routes, clock
        self.settings = settings or ControllerSettings()
        self.scheduling = scheduling or SchedulingStats()
        """Decisions, their latency, preemptions and defragmentation moves, for the cloud's metrics."""
        self.footprint = footprint
        self.wakeup = Wakeup()
        self.loop = ReevaluationLoop(scheduler, loop)
        self.loop_health = LoopHealth()
        self.events = events = EventLog(self.store)
        store, settings, wakeup, scheduling = self.store, self.settings, self.wakeup, self.scheduling
        self.reservations = reservations = Reservations(nodes, scheduler, footprint, store, wakeup)
        self.lifecycle = lifecycle = Lifecycle(
            store=store, launcher=launcher, routes=routes, reservations=reservations, events=events, clock=clock,
            settings=settings, repository=repository, wakeup=wakeup,
        )  # fmt: skip
        self.replacements = replacements = Replacements(
            store=store, lifecycle=lifecycle, reservations=reservations, events=events, clock=clock,
            settings=settings, scheduling=scheduling, wakeup=wakeup,
        )  # fmt: skip
        self.health = health = HealthChecker(
            store=store, launcher=launcher, prober=prober, lifecycle=lifecycle, replacements=replacements,
            reservations=reservations, events=events, clock=clock, settings=settings, wakeup=wakeup,
        )  # fmt: skip
        routes.on_eject.append(lambda e: health.probe_soon(e.replica_id))  # its readmission need not wait its turn
        self.executor = Executor(
            store=store, loop=self.loop, lifecycle=lifecycle, replacements=replacements, health=health,
            reservations=reservations, events=events, clock=clock, scheduling=scheduling, wakeup=wakeup,
        )  # fmt: skip
        self._wire_changes(launcher, routes, footprint, autoscaler, admission)

    def _wire_changes(
        self,
        launcher: ReplicaLauncher,
        routes: RouteTable,
        footprint: FootprintSource,
        autoscaler: Autoscaler | None,
        admission: DeployAdmission | None,
    ) -> None:
        """The parts that change the fleet on top of the lifecycle: reconciling (with autoscaling), adopting
        replicas found running, deploying, and node changes."""
        store, events, clock, wakeup = self.store, self.events, self.clock, self.wakeup
        lifecycle, replacements, reservations = self.lifecycle, self.replacements, self.reservations
        executor, health = self.executor, self.health
        autoscaling = Autoscaling(store=store, routes=routes, footprint=footprint,
                                  autoscaler=autoscaler or Autoscaler(), events=events, clock=clock)  # fmt: skip
        self.reconciler = Reconciler(store=store, lifecycle=lifecycle, replacements=replacements, executor=executor,
                                     reservations=reservations, autoscaling=autoscaling, events=events)  # fmt: skip
        self.adoption = Adoption(
            store=store, launcher=launcher, lifecycle=lifecycle, replacements=replacements, reservations=reservations,
            routes=routes, events=events, footprint=footprint,
        )  # fmt: skip
        self.deployer = Deployer(store=store, models=self.models, footprint=footprint, reservations=reservations,
                                 routes=routes, clock=clock, wakeup=wakeup, admission=admission)  # fmt: skip
        """Every deploy's checks, quota (``admission``: None, none) and event (:mod:`.deploys`)."""
        self.fleet = FleetChanges(store=store, reservations=reservations, lifecycle=lifecycle, health=health,
                                  loop=self.loop, events=events, wakeup=wakeup)  # fmt: skip

    @property
    def nodes(self) -> list[Node]:
        return self.reservations.nodes

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (replaced when a node joins the fleet)."""
        return self.reservations.scheduler

    # ---- the operator's API ----------------------------------------------------------------------------

    def deploy(self, spec: DeploymentSpec) -> Deployment:
        """Create a deployment, or replace one's spec as a whole (:meth:`apply` with every field set)."""
        return self.deployer.apply(DeployRequest.of(spec)).deployment

    def apply(self, request: DeployRequest) -> Deployed:
        """Create or update a deployment from the fields ``request`` sets (the others: the defaults, or what the
        operator set before), checked and admitted before anything is stored (:mod:`.deploys`). A new model,
        version or size is rolled out replica by replica (the old ones serve until their successor does)."""
        return self.deployer.apply(request)

    def has_model(self, model: str) -> bool:
        """Whether the model store holds ``model`` (raises StoreUnavailableError when it cannot tell now)."""
        try:
            self.models.versions(model)
        except NotFoundError:
            return False
        return True

    def sizing(self, spec: DeploymentSpec) -> Sizing:
        """The size ``spec`` resolves to and why; raises when it could never be placed on this fleet."""
        return self.deployer.sizing(spec)

    def capacity(self, priority: int = 0) -> FleetCapacity:
        """What the fleet could ever give a deployment of ``priority`` (the failover reserve kept from it)."""
        return self.deployer.capacity(priority)

    def scale(self, name: str, replicas: int) -> Deployment:
        d = self.store.get_deployment(name)
        if not d.spec.min_replicas <= replicas <= d.spec.max_replicas:
            raise InvalidSpecError(
                f"deployment {name!r}: replicas must be within {d.spec.min_replicas}..{d.spec.max_replicas}, "
                f"got {replicas} (change min/max with deploy)"
            )
        memory = self.reservations.memory_mib(d.spec.model)
        self.capacity(d.spec.priority).check(name, d.octants, replicas, memory)
        d.replicas = replicas
        d.generation += 1
        self.store.put_deployment(d)
        self.store.add_event("scale", name, f"{replicas} replica(s)", deployment=name, tenant=d.spec.tenant)
        self.poke()
        return d

    def undeploy(self, name: str) -> None:
        """Remove a deployment (one set aside as unreadable too); its replicas are drained and stopped in the
        background."""
        self.store.delete_deployment(name)  # NotFoundError when there is none
        self.routes.remove(name)
        self.store.delete_revisions(name)
        self.store.add_event("undeploy", name, "removed", deployment=name)  # stamped with the tenant it had
        for r in self.store.replicas(name):
            self.lifecycle.retire(r, "undeployed")
        self.poke()

    def prefetch(self, node: str, model: str, version: str) -> None:
        """Fetch ``model`` at ``version`` into ``node``'s cache ahead of a replica, when the launcher can (a warm
        copy for the failover reserve); never blocks, and a failure is logged, never raised."""
        self.lifecycle.prefetch(node, model, version)

    def status(self) -> list[tuple[Deployment, list[Replica]]]:
        return [(d, self.store.replicas(d.spec.name)) for d in self.store.deployments()]

    def rollout_status(self, name: str) -> dict[str, Any]:
        """Where deployment ``name``'s rollout stands: its revisions and which replicas run the current one."""
        return rollout_status(self.store, name)

    def rollout_undo(self, name: str, to_revision: int | None = None) -> Deployment:
        """Roll back to the model, version and octants of ``to_revision`` (default: the one before the current),
        as a new revision, replica by replica."""
        d = self.store.get_deployment(name)
        history = self.store.revisions(name)
        if to_revision is None:
            if len(history) < 2:
                raise InvalidSpecError(f"deployment {name!r} has no earlier revision to go back to")
            target = history[-2]
        else:
            found = [h for h in history if h[0] == to_revision]
            if not found:
                raise NotFoundError(f"deployment {name!r} has no revision {to_revision} (see rollout status)")
            target = found[0]
        spec = dataclasses.replace(d.spec, model=target[1].model, version=target[1].version, octants=target[2])
        return self.deploy(spec)

    # ---- what the fleet's watchers saw (:mod:`.fleet_changes`) --------------------------------------------

    def mark_node(self, name: str, health: Health) -> None:
        self.fleet.mark_node(name, health)

    def mark_card(self, node: str, gpu: int, health: Health, reason: str) -> None:
        self.fleet.mark_card(node, gpu, health, reason)

    def restart_gpu_replicas(self, node: str, why: str) -> None:
        self.fleet.restart_gpu_replicas(node, why)

    def node_changed(self, change: NodeChange) -> None:
        self.fleet.node_changed(change)

    def nodes_changed(self, changes: list[NodeChange]) -> None:
        """Several changes at once: the nodes among them that join, join together (:mod:`.fleet_changes`)."""
        self.fleet.nodes_changed(changes)

    # ---- the loop ----------------------------------------------------------------------------------------

    def poke(self) -> None:
        """Reconcile now rather than at the next tick."""
        self.wakeup.poke()

    def ready(self) -> tuple[bool, str]:
        """Whether the loop runs and completes iterations; when not, why (for readiness and status)."""
        h, s, now = self.loop_health, self.settings, self.clock.monotonic()
        if not h.running:
            return False, "the controller's loop is not running"
        failing = self.store.failing
        if failing is not None and now - failing[0] > s.stall_after_s:
            since = now - failing[0]
            return False, f"the state store has refused the controller's writes for {since:.0f} s: {failing[1]}"
        stalled = now - h.last_ok_at
        if stalled > s.stall_after_s:
            why = f": {h.failures} failed iteration(s) in a row, last: {h.last_error}" if h.failures else ""
            return False, f"the controller's loop has not completed an iteration for {stalled:.0f} s{why}"
        return True, ""

    def adopt(self) -> None:
        """On start: take over from the previous controller (:mod:`.adoption`)."""
        self.adoption.adopt()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; an iteration that raises is retried with back-off, never fatal."""
        h, s = self.loop_health, self.settings
        wake = self.wakeup.start()
        h.running, h.last_ok_at = True, self.clock.monotonic()
        adopted = False
        next_full = 0.0
        try:
            while not stop.is_set():
                try:
                    if not adopted:
                        self.adopt()
                        adopted = True
                    if self.clock.monotonic() >= next_full or wake.is_set():
                        wake.clear()
                        await self.reconcile()
                        next_full = self.clock.monotonic() + s.interval_s
                    else:
                        await self.check_health()
                except Exception as exc:
                    h.failures += 1
                    h.last_error = f"{type(exc).__name__}: {exc}"[:500]
                    log.exception("controller iteration failed (%d in a row); retrying", h.failures)
                    delay = min(s.backoff_max_s, s.backoff_base_s * 2 ** min(h.failures - 1, 16))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    continue
                h.failures, h.last_ok_at, h.last_error = 0, self.clock.monotonic(), ""
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), s.health_interval_s)
        finally:
            h.running = False
            await self.lifecycle.close()
            await asyncio.to_thread(self.store.flush, s.stop_grace_s + 5.0)

    async def reconcile(self) -> None:
        """One full pass: health, then desired vs actual, then the scheduler's loop."""
        await self.health.check()
        await self.reconciler.reconcile()

    async def check_health(self) -> None:
        await self.health.check()
