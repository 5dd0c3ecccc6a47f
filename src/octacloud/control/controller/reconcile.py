"""Reconcile: make what runs match what was asked for, then let the scheduler's loop place what waits.

One full pass (every ``interval_s``, and at once after a change):

1. **autoscale**: a deployment with a target load moves its desired count within min..max;
2. **count**: too many replicas → the least useful are retired (pending, then not ready, then newest); too few →
   new pending replicas; replicas of removed deployments are retired;
3. **roll out**: replicas whose template (model, version, octants) is not their deployment's are replaced one
   at a time (surge 1, none unavailable) by make-before-break; one that is not running is updated in place;
4. **place**: the pending replicas go to :meth:`ReevaluationLoop.run_pass` (place by priority → preempt →
   defragment) and the executor carries out the operations it returns.

A deployment whose steps raise (its model's footprint cannot be read, say) is left out of the pass, with a
``quarantine`` event the first time it fails that way; the other deployments are reconciled and placed as usual,
and it is tried again on the next pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from octacloud.control.controller.executor import Executor, new_replica_id
from octacloud.control.controller.world import World, log
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.control.sizing import Autoscaler, LoadSample
from octacloud.control.store import Transition
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Request
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
        self._failing: dict[str, tuple[int, str]] = {}
        """Deployments left out of the latest pass → (generation, error): their event is not repeated."""
        self._failed: set[str] = set()

    def _guard(self, deployments: dict[str, Deployment], name: str, step: Callable[[], object]) -> None:
        """Run one deployment's ``step``; when it raises, leave that deployment out of this pass (the rest goes
        on), and say so once per generation and error."""
        try:
            step()
        except Exception as exc:
            d = deployments.pop(name)
            self._failed.add(name)
            why = f"{type(exc).__name__}: {exc}"[:300]
            if self._failing.get(name) != (d.generation, why):
                self._failing[name] = (d.generation, why)
                log.exception("deployment %s cannot be reconciled; left out of this pass", name)
                self.w.event(
                    "quarantine", name, f"cannot be reconciled ({why}): left out of scheduling while it fails, "
                    "the rest of the cloud carries on", name,
                )  # fmt: skip

    async def reconcile(self) -> None:
        w = self.w
        deployments = {d.spec.name: d for d in w.store.deployments()}
        stored = set(deployments)  # (one left out of this pass keeps its replicas)
        self._failed = set()
        for name in list(deployments):
            self._guard(deployments, name, partial(self.autoscale, {name: deployments[name]}))
        revisions = {name: self._revision(name) for name in deployments}
        for r in w.store.replicas():
            if r.id in w.stopping:
                continue
            if r.state is ReplicaState.STOPPING:  # its stop was interrupted (a restart, a store error): finish it
                self.x.retire(r, "stopping")
            elif r.deployment not in stored:
                self.x.retire(r, "deployment removed")
        for name, d in list(deployments.items()):
            self._guard(deployments, name, partial(self._update, d, revisions[name]))
        await self.place(deployments)
        for name in deployments:
            w.route(name)
        for name in set(self._failing) - self._failed:  # it works again
            del self._failing[name]

    def _update(self, d: Deployment, revision: int) -> None:
        self._count(d, revision)
        self._roll_out(d, revision)

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
        asked: dict[str, Request] = {}

        def ask(r: Replica) -> None:
            asked[r.id] = w.request(r, deployments[r.deployment])

        pending = [r for r in w.store.replicas() if r.state is ReplicaState.PENDING and not r.placed]
        for r in pending:
            if r.deployment in deployments:
                self._guard(deployments, r.deployment, partial(ask, r))
        waiting = [r for r in pending if r.id in asked and r.deployment in deployments]
        requests = {r.id: asked[r.id] for r in waiting}
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
            if d.spec.min_replicas == d.spec.max_replicas:
                continue
            try:
                footprint = w.footprint(d.spec.model)
            except (NotFoundError, InvalidSpecError):
                footprint = None
            generative = footprint is not None and footprint.generative
            if d.spec.target_qps is None and not generative:
                continue
            c = w.routes.counter(name)
            last = self._load.get(name)
            if generative:  # the engine's pressure: sequences in flight over its slots, and time to first token
                self._load[name] = (now, c.first_tokens, c.first_token_us_total)
            else:
                self._load[name] = (now, c.requests, c.latency_us_total)
            if last is None or now <= last[0]:
                continue
            n = self._load[name][1] - last[1]
            mean_ms = (self._load[name][2] - last[2]) / 1000 / n if n else 0.0
            if footprint is not None and generative:
                sample = LoadSample(qps=float(c.outstanding), outstanding=float(c.outstanding), mean_latency_ms=mean_ms)
                capacity = float(footprint.max_batch)
            else:
                sample = LoadSample(qps=n / (now - last[0]), outstanding=float(c.outstanding), mean_latency_ms=mean_ms)
                capacity = (d.spec.target_qps or 0.0) / max(1, d.spec.min_replicas)
                per_card = footprint.samples_per_second_per_card if footprint is not None else None
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
                at = f"{sample.qps:.0f} sequence(s) in flight" if generative else f"{sample.qps:.1f} req/s"
                w.event("autoscale", name, f"{d.replicas} → {wanted} at {at}", name)
                d.replicas = wanted
                w.store.put_deployment(d)
