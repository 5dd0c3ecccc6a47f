"""Reconcile: make what runs match what was asked for, then let the scheduler's loop place what waits.

One full pass (every ``interval_s``, and at once after a change):

1. **autoscale**: a deployment with a target load moves its desired count within min..max (:mod:`.autoscale`);
2. **count**: too many replicas → the least useful are retired (pending, then not ready, then newest); too few →
   new pending replicas; replicas of removed deployments are retired;
3. **roll out**: replicas whose template (model, version, octants) is not their deployment's are replaced one
   at a time (surge 1, none unavailable) by make-before-break (:mod:`.replacement`); one that is not running is
   updated in place;
4. **place**: the pending replicas go to the scheduler's re-evaluation pass, and the executor carries out the
   operations it returns (:mod:`.executor`).

A deployment whose steps raise (its model's footprint cannot be read, say) is left out of the pass, with a
``quarantine`` event the first time it fails that way; the other deployments are reconciled and placed as usual,
and it is tried again on the next pass.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from octacloud.control.controller.autoscale import Autoscaling
from octacloud.control.controller.contracts import log
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.executor import Executor
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.replacement import Replacements
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore, copied
from octacloud.control.deployments import Deployment, Replica, ReplicaState, new_replica_id
from octacloud.core.model import Request


class Reconciler:
    def __init__(
        self,
        *,
        store: ControllerStore,
        lifecycle: Lifecycle,
        replacements: Replacements,
        executor: Executor,
        reservations: Reservations,
        autoscaling: Autoscaling,
        events: EventLog,
    ) -> None:
        self.store, self.lifecycle, self.replacements = store, lifecycle, replacements
        self.executor, self.reservations, self.autoscaling, self.events = executor, reservations, autoscaling, events
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
                self.events.record(
                    "quarantine", name, f"cannot be reconciled ({why}): left out of scheduling while it fails, "
                    "the rest of the cloud carries on", name,
                )  # fmt: skip

    async def reconcile(self) -> None:
        deployments = {d.spec.name: d for d in self.store.deployments()}
        stored = set(deployments)  # (one left out of this pass keeps its replicas)
        self._failed = set()
        for name in list(deployments):
            self._guard(deployments, name, partial(self.autoscaling.autoscale, {name: deployments[name]}))
        revisions = {name: self._revision(name) for name in deployments}
        for r in self.store.peek_replicas():  # (a look at each; a copy of the few retired)
            if self.lifecycle.is_stopping(r.id):
                continue
            if r.state is ReplicaState.STOPPING:  # its stop was interrupted (a restart, a store error): finish it
                self.lifecycle.retire(copied(r), "stopping")
            elif r.deployment not in stored:
                self.lifecycle.retire(copied(r), "deployment removed")
        for name, d in list(deployments.items()):
            self._guard(deployments, name, partial(self._update, d, revisions[name]))
        waiting, requests = self._requests(deployments)
        await self.executor.place(deployments, waiting, requests)
        for name in deployments:
            self.lifecycle.route(name)
        for name in set(self._failing) - self._failed:  # it works again
            del self._failing[name]

    def _update(self, d: Deployment, revision: int) -> None:
        self._count(d, revision)
        self._roll_out(d, revision)

    def _requests(self, deployments: dict[str, Deployment]) -> tuple[list[Replica], dict[str, Request]]:
        """The replicas that wait to be placed and the scheduler's request for each (a deployment whose requests
        cannot be made is left out of the pass)."""
        asked: dict[str, Request] = {}

        def ask(r: Replica) -> None:
            asked[r.id] = self.reservations.request(r, deployments[r.deployment])

        peek = self.store.peek_replicas()
        pending = [
            copied(r) for r in sorted(peek, key=lambda r: r.id) if r.state is ReplicaState.PENDING and not r.placed
        ]
        for r in pending:
            if r.deployment in deployments:
                self._guard(deployments, r.deployment, partial(ask, r))
        waiting = [r for r in pending if r.id in asked and r.deployment in deployments]
        return waiting, {r.id: asked[r.id] for r in waiting}

    def _live(self, name: str) -> list[Replica]:
        """``name``'s replicas that are not being stopped, as stored (look, or change a copy)."""
        return [
            r
            for r in sorted(self.store.peek_replicas(name), key=lambda r: r.id)
            if not self.lifecycle.is_stopping(r.id) and r.state is not ReplicaState.STOPPING
        ]

    def _revision(self, name: str) -> int:
        revisions = self.store.revisions(name)
        return revisions[-1][0] if revisions else 0

    def _count(self, d: Deployment, revision: int) -> None:
        replicas = [r for r in self._live(d.spec.name) if not r.replaces]
        for i, r in enumerate(replicas):
            if not r.octants:  # from before templates: it runs what its deployment asked for when it started
                r = replicas[i] = copied(r)
                r.model, r.version, r.octants, r.revision = *d.template(), revision
                self.store.put_replica(r)
        surplus = len(replicas) - d.replicas
        if surplus > 0:  # the least useful first: pending, then not ready, then newest
            order = sorted(replicas, key=lambda r: (r.state is ReplicaState.READY, r.placed, -r.started_at, r.id))
            for r in order[:surplus]:
                self.lifecycle.retire(copied(r), "scaled down")
        model, version, octants = d.template()
        for _ in range(-surplus):
            new = Replica(new_replica_id(d.spec.name), d.spec.name, model=model, version=version, octants=octants)
            new.revision = revision
            self.store.put_replica(new)

    def _roll_out(self, d: Deployment, revision: int) -> None:
        live = self._live(d.spec.name)
        outdated = [copied(r) for r in live if not r.replaces and r.template() != d.template()]
        for r in outdated:
            if (r.state is ReplicaState.PENDING and not r.placed) or r.state is ReplicaState.FAILED:
                self.reservations.release(r.id)
                r.model, r.version, r.octants, r.revision = *d.template(), revision
                r.unplace(f"updated to revision {revision}")
                self.store.put_replica(r)
        running = [r for r in outdated if r.state in (ReplicaState.READY, ReplicaState.STARTING) and r.handle]
        surging = [r for r in live if r.replaces]
        if not running or surging or not self.replacements.may_roll_out(d.spec.name):
            return
        old = min(running, key=lambda r: (r.state is ReplicaState.READY, r.started_at, r.id))
        self.replacements.begin_update(d, old, revision, len(running))
