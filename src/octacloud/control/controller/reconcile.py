"""Reconcile: make what runs match what was asked for, then let the scheduler's loop place what waits.

One full pass (every ``interval_s``, and at once after a change):

1. **autoscale**: a deployment with a target load moves its desired count within min..max;
2. **count**: too many replicas → the least useful are retired (pending, then not ready, then newest); too few →
   new pending replicas; replicas of removed deployments are retired;
3. **roll out**: replicas whose template (model, version, octants) is not their deployment's are replaced one
   at a time (surge 1, none unavailable) by make-before-break; one that is not running is updated in place;
4. **place**: the pending replicas go to :meth:`ReevaluationLoop.run_pass` (place by priority → preempt →
   defragment) and the executor carries out the operations it returns.
"""

from __future__ import annotations

import math

from octacloud.control.controller.executor import Executor, new_replica_id
from octacloud.control.controller.world import World
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.sizing import Autoscaler, LoadSample
from octacloud.control.store import Transition
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.units import OCTANTS_PER_GPU
from octacloud.observability.scheduling import Outcome
from octacloud.scheduler.loop import Evict, PassReport, ReevaluationLoop, Start


class Reconciler:
    def __init__(self, world: World, executor: Executor, loop: ReevaluationLoop, autoscaler: Autoscaler) -> None:
        self.w = world
        self.x = executor
        self.loop = loop
        self.autoscaler = autoscaler
        self._load: dict[str, tuple[float, int, int]] = {}
        self.last: PassReport | None = None
        """The latest pass's report (what the executor was asked to carry out)."""

    async def reconcile(self) -> None:
        w = self.w
        deployments = {d.spec.name: d for d in w.store.deployments()}
        self.autoscale(deployments)
        revisions = {name: self._revision(name) for name in deployments}
        for r in w.store.replicas():
            if r.id in w.stopping:
                continue
            if r.state is ReplicaState.STOPPING:  # its stop was interrupted (a restart, a store error): finish it
                self.x.retire(r, "stopping")
            elif r.deployment not in deployments:
                self.x.retire(r, "deployment removed")
        for name, d in deployments.items():
            self._count(d, revisions[name])
            self._roll_out(d, revisions[name])
        await self.place(deployments)
        for name in deployments:
            w.route(name)

    def _live(self, name: str) -> list[Replica]:
        w = self.w
        return [r for r in w.store.replicas(name) if r.id not in w.stopping and r.state is not ReplicaState.STOPPING]

    def _revision(self, name: str) -> int:
        revisions = self.w.store.revisions(name)
        return revisions[-1][0] if revisions else 0

    def _count(self, d: Deployment, revision: int) -> None:
        w = self.w
        replicas = [r for r in self._live(d.spec.name) if not r.replaces]
        for r in replicas:
            if not r.octants:  # from before templates: it runs what its deployment asked for when it started
                r.model, r.version, r.octants, r.revision = *d.template(), revision
                w.store.put_replica(r)
        surplus = len(replicas) - d.replicas
        if surplus > 0:  # the least useful first: pending, then not ready, then newest
            order = sorted(replicas, key=lambda r: (r.state is ReplicaState.READY, r.placed, -r.started_at, r.id))
            for r in order[:surplus]:
                self.x.retire(r, "scaled down")
        for _ in range(-surplus):
            w.store.put_replica(self._new(d, revision))

    def _new(self, d: Deployment, revision: int, replaces: str = "") -> Replica:
        model, version, octants = d.template()
        return Replica(
            id=new_replica_id(d.spec.name),
            deployment=d.spec.name,
            model=model,
            version=version,
            octants=octants,
            revision=revision,
            replaces=replaces,
        )

    def _roll_out(self, d: Deployment, revision: int) -> None:
        w = self.w
        live = self._live(d.spec.name)
        outdated = [r for r in live if not r.replaces and r.template() != d.template()]
        for r in outdated:
            if (r.state is ReplicaState.PENDING and not r.placed) or r.state is ReplicaState.FAILED:
                w.release(r.id)
                r.model, r.version, r.octants, r.revision = *d.template(), revision
                w.to_pending(r, f"updated to revision {revision}")
        running = [r for r in outdated if r.state in (ReplicaState.READY, ReplicaState.STARTING) and r.handle]
        surging = [r for r in live if r.replaces]
        if not running or surging or w.clock.monotonic() < self.x.rollout_backoff.get(d.spec.name, 0.0):
            return
        old = min(running, key=lambda r: (r.state is ReplicaState.READY, r.started_at, r.id))
        surge = self._new(d, revision, replaces=old.id)
        t = Transition(surge.id, old.id, "update", d.spec.name)
        w.store.begin_replacement(surge, t)
        w.transitions[surge.id] = t
        w.event("rollout", surge.id, f"revision {revision}: replacing {old.id} ({len(running)} to go)", d.spec.name)

    async def place(self, deployments: dict[str, Deployment]) -> None:
        """Hand the pending replicas to the loop's pass and carry out what it decides."""
        w = self.w
        waiting = [
            r
            for r in w.store.replicas()
            if r.state is ReplicaState.PENDING and not r.placed and r.deployment in deployments
        ]
        requests = {r.id: w.request(r, deployments[r.deployment]) for r in waiting}
        report = self.last = self.loop.run_pass(w.clock.monotonic(), list(requests.values()))
        w.waiting = sum(1 for r in report.pending if r.name in requests)
        per_decision = report.seconds / max(1, len(requests))
        evicted = {op.victim.request.name for op in report.operations if isinstance(op, Evict)}
        for op in report.operations:
            if isinstance(op, Start):
                preempted = any(a in evicted for a in op.after)
                w.scheduling.decision(Outcome.PREEMPTED if preempted else Outcome.PLACED, per_decision)
        for request in report.pending:
            if request.name not in requests:  # a victim of this pass: it is re-queued by its stop
                continue
            w.scheduling.decision(Outcome.UNSCHEDULABLE, per_decision)
            r = next(x for x in waiting if x.id == request.name)
            why = w.scheduler.decide(request).explain()
            if r.message != why:
                r.message = why
                w.store.put_replica(r)
                w.replica_event("unschedulable", r, why)
        await self.x.execute(report.operations, deployments)

    def autoscale(self, deployments: dict[str, Deployment]) -> None:
        w = self.w
        now = w.clock.monotonic()
        for name, d in deployments.items():
            if d.spec.min_replicas == d.spec.max_replicas or d.spec.target_qps is None:
                continue
            c = w.routes.counter(name)
            last = self._load.get(name)
            self._load[name] = (now, c.requests, c.latency_us_total)
            if last is None or now <= last[0]:
                continue
            n = c.requests - last[1]
            sample = LoadSample(
                qps=n / (now - last[0]),
                outstanding=float(c.outstanding),
                mean_latency_ms=(c.latency_us_total - last[2]) / 1000 / n if n else 0.0,
            )
            capacity = d.spec.target_qps / max(1, d.spec.min_replicas)
            try:
                per_card = w.footprint(d.spec.model).samples_per_second_per_card
            except (NotFoundError, InvalidSpecError):
                per_card = None
            if per_card:
                capacity = per_card * d.octants / OCTANTS_PER_GPU
            ready = [r for r in w.store.replicas(name) if r.state is ReplicaState.READY and not r.replaces]
            wanted = self.autoscaler.desired(
                name,
                now,
                len(ready) or d.replicas,
                sample,
                capacity_qps=capacity,
                slo_ms=d.spec.slo_ms,
                min_replicas=d.spec.min_replicas,
                max_replicas=d.spec.max_replicas,
            )
            if wanted != d.replicas and not math.isnan(sample.qps):
                w.event("autoscale", name, f"{d.replicas} → {wanted} at {sample.qps:.1f} req/s", name)
                d.replicas = wanted
                w.store.put_deployment(d)
