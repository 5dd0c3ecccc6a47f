"""The controller: the operator's API (deploy, scale, undeploy, rollouts) and the loop that drives the parts.

Every ``health_interval_s`` it checks health (:mod:`.health`); every ``interval_s`` (and at once after a change)
it reconciles (:mod:`.reconcile`), whose placement step is the scheduler's own re-evaluation loop; the executor
(:mod:`.executor`) carries out what was decided without blocking the event loop the gateway shares.

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

from octacloud.control.controller.deploys import DeployAdmission, Deployed, Deployer, route
from octacloud.control.controller.executor import Executor
from octacloud.control.controller.health import HealthChecker
from octacloud.control.controller.reconcile import Reconciler
from octacloud.control.controller.state import ControllerStore, as_controller_store
from octacloud.control.controller.world import (
    ControllerSettings,
    FootprintSource,
    NodeChange,
    Prober,
    World,
    log,
)
from octacloud.control.deploy_request import DeployRequest
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.control.launcher import ReplicaLauncher
from octacloud.control.sizing import Autoscaler, FleetCapacity, Sizing
from octacloud.control.store import StateStore, Transition
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node
from octacloud.gateway.routing import RouteTable
from octacloud.observability.scheduling import SchedulingStats
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
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
        self.w = World(
            as_controller_store(store, clock), nodes, scheduler, launcher, repository, routes, clock, prober, footprint,
            settings or ControllerSettings(), scheduling or SchedulingStats(),
        )  # fmt: skip
        self.loop = ReevaluationLoop(scheduler, loop)
        self.executor = Executor(self.w)
        self.deployer = Deployer(self.w, self.models, admission)
        """Every deploy's checks, quota (``admission``: None, none) and event (:mod:`.deploys`)."""
        self.health = HealthChecker(self.w, self.executor)
        self.reconciler = Reconciler(self.w, self.executor, self.loop, autoscaler or Autoscaler())
        self.loop_health = LoopHealth()

    # ---- the seams and state other parts of the cloud read ------------------------------------------------

    @property
    def store(self) -> ControllerStore:
        """The state store as the controller sees it: read from memory, written behind by one thread."""
        return self.w.store

    @property
    def nodes(self) -> list[Node]:
        return self.w.nodes

    @property
    def launcher(self) -> ReplicaLauncher:
        return self.w.launcher

    @property
    def repository(self) -> Path:
        return self.w.repository

    @property
    def routes(self) -> RouteTable:
        return self.w.routes

    @property
    def settings(self) -> ControllerSettings:
        return self.w.settings

    @property
    def scheduling(self) -> SchedulingStats:
        """Decisions, their latency, preemptions and defragmentation moves, for the cloud's metrics."""
        return self.w.scheduling

    @property
    def scheduler(self) -> Scheduler:
        return self.w.scheduler

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
        d = self.w.store.get_deployment(name)
        if not d.spec.min_replicas <= replicas <= d.spec.max_replicas:
            raise InvalidSpecError(
                f"deployment {name!r}: replicas must be within {d.spec.min_replicas}..{d.spec.max_replicas}, "
                f"got {replicas} (change min/max with deploy)"
            )
        try:
            memory = self.w.footprint(d.spec.model).memory_mib
        except (NotFoundError, InvalidSpecError):
            memory = 0
        self.capacity(d.spec.priority).check(name, d.octants, replicas, memory)
        d.replicas = replicas
        d.generation += 1
        self.w.store.put_deployment(d)
        self.w.store.add_event("scale", name, f"{replicas} replica(s)", deployment=name, tenant=d.spec.tenant)
        self.poke()
        return d

    def undeploy(self, name: str) -> None:
        """Remove a deployment (one set aside as unreadable too); its replicas are drained and stopped in the
        background."""
        w = self.w
        w.store.delete_deployment(name)  # NotFoundError when there is none
        w.routes.remove(name)
        w.store.delete_revisions(name)
        w.store.add_event("undeploy", name, "removed", deployment=name)  # stamped with the tenant it had
        for r in w.store.replicas(name):
            self.executor.retire(r, "undeployed")
        w.poke()

    def status(self) -> list[tuple[Deployment, list[Replica]]]:
        return [(d, self.w.store.replicas(d.spec.name)) for d in self.w.store.deployments()]

    def rollout_status(self, name: str) -> dict[str, Any]:
        """Where deployment ``name``'s rollout stands: its revisions and which replicas run the current one."""
        w = self.w
        d = w.store.get_deployment(name)
        replicas = w.store.replicas(name)
        history = w.store.revisions(name)
        current = history[-1][0] if history else 0
        rows = [
            {
                "id": r.id,
                "state": r.state.value,
                "revision": r.revision,
                "up_to_date": w.template(r, d) == d.template(),
                "replaces": r.replaces,
                "ready_since": r.last_ready_at if r.state is ReplicaState.READY else None,
                "message": r.message,
            }
            for r in replicas
        ]
        serving = [x for x in rows if not x["replaces"] and x["state"] != ReplicaState.STOPPING.value]
        updated = sum(1 for x in serving if x["up_to_date"] and x["state"] == ReplicaState.READY.value)
        return {
            "deployment": name,
            "revision": current,
            "model": d.spec.model,
            "version": d.spec.version,
            "octants": d.octants,
            "desired": d.replicas,
            "updated": updated,
            "complete": updated == d.replicas and len(serving) == d.replicas,
            "replicas": rows,
            "history": [
                {"revision": n, "model": s.model, "version": s.version, "octants": o, "at": at}
                for n, s, o, at in history
            ],
        }

    def rollout_undo(self, name: str, to_revision: int | None = None) -> Deployment:
        """Roll back to the model, version and octants of ``to_revision`` (default: the one before the current),
        as a new revision, replica by replica."""
        w = self.w
        d = w.store.get_deployment(name)
        history = w.store.revisions(name)
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

    def poke(self) -> None:
        """Reconcile now rather than at the next tick."""
        self.w.poke()

    def ready(self) -> tuple[bool, str]:
        """Whether the loop runs and completes iterations; when not, why (for readiness and status)."""
        h, s = self.loop_health, self.w.settings
        if not h.running:
            return False, "the controller's loop is not running"
        failing = self.w.store.failing
        if failing is not None and self.w.clock.monotonic() - failing[0] > s.stall_after_s:
            since = self.w.clock.monotonic() - failing[0]
            return False, f"the state store has refused the controller's writes for {since:.0f} s: {failing[1]}"
        stalled = self.w.clock.monotonic() - h.last_ok_at
        if stalled > s.stall_after_s:
            why = f": {h.failures} failed iteration(s) in a row, last: {h.last_error}" if h.failures else ""
            return False, f"the controller's loop has not completed an iteration for {stalled:.0f} s{why}"
        return True, ""

    # ---- the loop ----------------------------------------------------------------------------------------

    def adopt(self) -> None:
        """On start: rebuild the scheduler's state from the store, adopting replicas that still run, then the
        replacements that were in flight (:meth:`_undo_unfinished`, then :meth:`_carry_on`)."""
        w = self.w
        for d in w.store.deployments():
            route(w, d.spec)
        carry_on, moved_away = self._undo_unfinished()
        for r in sorted(w.store.replicas(), key=lambda r: not r.handle):  # what runs keeps its slice first
            if not r.placed or w.holds(r.id) or r.id in moved_away:
                continue
            try:
                w.scheduler.commit(w.request(r, w.store.get_deployment(r.deployment)), w.placement(r))
            except (InvalidSpecError, NotFoundError) as exc:
                log.warning("replica %s: cannot re-account its slice (%s); re-placing it", r.id, exc)
                w.to_pending(r, f"slice lost across restart: {exc}")
                continue
            if not r.handle and r.pid is not None:  # stored before launchers had handles: a local PID
                r.handle = str(r.pid)
            if r.state is ReplicaState.PENDING:
                continue  # placed, waiting for its slice to be free: launched by the health check
            if not r.handle or not w.launcher.alive(r.handle):
                r.state, r.handle, r.pid = ReplicaState.FAILED, "", None
                r.message = "not running after controller restart"
                w.store.put_replica(r)
        for d in w.store.deployments():
            w.route(d.spec.name)
        for t in carry_on:
            self._carry_on(t)
        self._stop_strays()

    def _stop_strays(self) -> None:
        """Stop the replicas that run but that the store does not know: launched the moment before the previous
        controller died, their handle never stored (the launcher finds them on the machine; a launcher that
        cannot tell its cloud's replicas from others' finds none)."""
        w = self.w
        running = w.launcher.handles()
        if not running:
            return
        known: set[str] = set()
        for r in w.store.replicas():
            if r.handle:
                known.add(r.handle)
            if r.pid is not None:  # records from before handles
                known.add(str(r.pid))
        for handle in running:
            if handle not in known:
                log.warning("replica process %s runs but no replica of the store has it: stopping it", handle)
                self.executor.kill(handle)
                w.event("stray replica stopped", handle, "it ran without a record (launched just before a restart)")

    def _undo_unfinished(self) -> tuple[list[Transition], set[str]]:
        """Sort the replacements a restart interrupted: one whose replacement is not READY (or no longer runs)
        while the old replica still does is rolled back (the replacement stopped and forgotten, the old one
        serves on, what a move placed on its slice goes back to pending); the others carry on from their phase.
        Returns those that carry on, and the sources of the moves among them (their slice is already someone
        else's: it is not re-accounted to them)."""
        w, x = self.w, self.executor
        replicas = {r.id: r for r in w.store.replicas()}
        carry_on: list[Transition] = []
        for t in w.store.transitions():
            surge, old = replicas.get(t.replacement), replicas.get(t.source)
            surge_runs = surge is not None and bool(surge.handle) and w.launcher.alive(surge.handle)
            old_runs = old is not None and bool(old.handle) and w.launcher.alive(old.handle)
            ready = surge is not None and surge_runs and surge.state is ReplicaState.READY
            if surge is None or (old is None and not ready):
                w.store.delete_transition(t.replacement)  # nothing left to take over from or to
                continue
            if ready or not old_runs or old is None:
                w.transitions[t.replacement] = t
                carry_on.append(t)
                continue
            if surge.handle and surge_runs:
                x.kill(surge.handle)
            w.store.delete_replica(surge.id)
            w.store.delete_transition(t.replacement)
            if old.state is ReplicaState.STOPPING:  # it was draining for a replacement that no longer runs
                old.state = ReplicaState.READY
                w.store.put_replica(old)
            if t.kind == "move":
                for waiter in w.store.replicas():
                    if old.id in waiter.after:
                        w.to_pending(waiter, "the move that made room for it was interrupted by a restart")
                w.replica_event("move rolled back", old, f"{surge.id} was not ready at restart; {old.id} serves on")
            else:
                w.event("rollout failed", surge.id, f"not ready at restart; {old.id} serves on", t.deployment)
        moved_away = {t.source for t in carry_on if t.kind == "move"}
        return carry_on, moved_away

    def _carry_on(self, t: Transition) -> None:
        """Finish replacement ``t`` from the phase it had reached (its replacement is READY, or the replica it
        replaces no longer runs)."""
        w, x = self.w, self.executor
        replicas = {r.id: r for r in w.store.replicas(t.deployment)}
        surge, old = replicas.get(t.replacement), replicas.get(t.source)
        if surge is None:
            w.end_transition(t.replacement)
            return
        if surge.replaces and surge.state is ReplicaState.READY:  # it was ready, not yet routed
            x.complete(surge)
            return
        if surge.replaces:  # neither runs any longer: the surge restarts as an ordinary replica
            surge.replaces = ""
            w.store.put_replica(surge)
        w.route(t.deployment)
        x.pin(surge.id)
        if old is None:
            w.end_transition(t.replacement)
            x.pin(surge.id, pinned=False)
        elif t.phase == "releasing" or not (old.handle and w.launcher.alive(old.handle)):
            w.phase(t, "releasing")
            x.release_stopped(old, t)
            w.replica_event("stopped", old, f"replaced by {surge.id} (finished after a restart)")
        else:
            x.retire(old, f"replaced by {surge.id} (carried on after a restart)", transition=t)

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; an iteration that raises is retried with back-off, never fatal."""
        w, h = self.w, self.loop_health
        w.wake = asyncio.Event()
        h.running, h.last_ok_at = True, w.clock.monotonic()
        adopted = False
        next_full = 0.0
        try:
            while not stop.is_set():
                try:
                    if not adopted:
                        self.adopt()
                        adopted = True
                    if w.clock.monotonic() >= next_full or w.wake.is_set():
                        w.wake.clear()
                        await self.reconcile()
                        next_full = w.clock.monotonic() + w.settings.interval_s
                    else:
                        await self.check_health()
                except Exception as exc:
                    h.failures += 1
                    h.last_error = f"{type(exc).__name__}: {exc}"[:500]
                    log.exception("controller iteration failed (%d in a row); retrying", h.failures)
                    delay = min(w.settings.backoff_max_s, w.settings.backoff_base_s * 2 ** min(h.failures - 1, 16))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    continue
                h.failures, h.last_ok_at, h.last_error = 0, w.clock.monotonic(), ""
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.wake.wait(), w.settings.health_interval_s)
        finally:
            h.running = False
            await self.executor.close()
            await asyncio.to_thread(w.store.flush, w.settings.stop_grace_s + 5.0)

    async def reconcile(self) -> None:
        """One full pass: health, then desired vs actual, then the scheduler's loop."""
        await self.health.check()
        await self.reconciler.reconcile()

    async def check_health(self) -> None:
        await self.health.check()

    # ---- the fleet ---------------------------------------------------------------------------------------

    def mark_node(self, name: str, health: Health) -> None:
        """A node failed (or recovered): its replicas are re-placed elsewhere on the next pass."""
        w = self.w
        w.scheduler.state.set_node_health(name, health)
        w.store.add_event("node", name, health.value)
        if health is Health.FAILED:
            self._fail_over([r for r in w.store.replicas() if r.node == name], f"node {name} failed")
        self.poke()

    def mark_card(self, node: str, gpu: int, health: Health, reason: str) -> None:
        """A card's health changed (NVML: an XID, ECC errors, a lost GPU): a DEGRADED card takes no new
        replicas; a FAILED one also fails its replicas over to other cards (using the failover headroom)."""
        w = self.w
        w.scheduler.state.set_card_health(node, gpu, health)
        w.store.add_event("node", node, f"card {gpu} {health.value}: {reason}")
        if health is Health.FAILED:
            on_card = [r for r in w.store.replicas() if r.node == node and gpu in r.gpus]
            self._fail_over(on_card, f"card {gpu} of {node} failed ({reason})")
        self.poke()

    def restart_gpu_replicas(self, node: str, why: str) -> None:
        """The GPU replicas of ``node`` lost their CUDA contexts (its MPS server died): each restarts on its
        slice, with the usual back-off."""
        gpu_cards = {g.index for n in self.w.nodes if n.name == node for g in n.gpus if g.model != CPU_CARD_MODEL}
        for r in self.w.store.replicas():
            if r.node == node and r.handle and gpu_cards.intersection(r.gpus):
                self.executor.failed(r, why, kill=True)
        self.poke()

    def _fail_over(self, replicas: list[Replica], why: str) -> None:
        w = self.w
        for r in replicas:
            if r.replaces:  # a replacement that was starting there: rolled back
                self.executor.failed(r, why, kill=True)
                continue
            w.unroute(r.id, gone=True)  # first: the gateway stops routing to it, and ends what is in flight there
            if r.handle:
                self.executor.kill(r.handle)
            w.release(r.id)
            w.to_pending(r, why, failover=True)
            w.replica_event("failover", r, f"{why}: re-placed elsewhere")

    def node_changed(self, change: NodeChange) -> None:
        """Apply what a fleet watcher saw: a new node joins the fleet (the scheduler may use it at once), a known
        node that was lost comes back, or a node is lost (its replicas are re-placed on the others)."""
        name = change.node.name
        state = self.w.scheduler.state
        if change.health is Health.FAILED:
            if name in state.index and state.nodes[state.index[name]].health is not Health.FAILED:
                self.mark_node(name, Health.FAILED)
            return
        if name not in state.index:
            self._grow_fleet(change.node)
            cards = f"{change.node.gpu_count} × {change.node.gpu_model or 'no card'}"
            self.w.store.add_event("node", name, f"joined: {cards}")
            self.poke()
        elif state.nodes[state.index[name]].health is not Health.HEALTHY:
            self.mark_node(name, Health.HEALTHY)

    def _grow_fleet(self, node: Node) -> None:
        """Rebuild the scheduler's state with ``node`` added, carrying over every allocation and health."""
        old = self.w.scheduler.state
        fresh = ClusterState([*(_all_healthy(n) for n in old.nodes), _all_healthy(node)])
        scheduler = Scheduler(fresh, self.w.scheduler.profile)
        for a in old:
            scheduler.commit(a.request, a.placement)
        for n in [*old.nodes, node]:
            for g in n.gpus:
                if g.health is not Health.HEALTHY:
                    fresh.set_card_health(n.name, g.index, g.health)
            if n.health is not Health.HEALTHY:
                fresh.set_node_health(n.name, n.health)
        self.w.scheduler = scheduler
        self.loop.scheduler = scheduler
        self.w.nodes.append(node)


def _all_healthy(node: Node) -> Node:
    gpus = tuple(dataclasses.replace(g, health=Health.HEALTHY) for g in node.gpus)
    return dataclasses.replace(node, gpus=gpus, health=Health.HEALTHY)
