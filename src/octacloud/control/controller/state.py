"""The controller's state store, kept off the event loop it shares with the gateway.

SQLite (or PostgreSQL) calls can wait for seconds: another connection holds the write lock (a backup, an
operator's ``sqlite3`` shell, a second ``octacloud`` command), the disk is busy, the server is far. In
single-process mode the controller runs on the gateway's event loop, so a write that waits there stalls every
request the gateway is serving. :class:`ControllerStore` keeps the same contract,
:class:`~octacloud.control.store.Store`, as :class:`~octacloud.control.store.StateStore` does, but

* **reads from memory**: the controller is the store's only writer, so a copy loaded at start and updated by its
  own writes is exactly what the database holds (or will hold); every read returns fresh copies, as a database
  read does, so no decision changes;
* **writes behind, in order, on one thread**: a write is applied to the copy at once and queued for the store
  thread, which applies the queue in order, up to :data:`BATCH` writes in one transaction, retrying an
  operational error (the database is locked, the disk is full) with back-off rather than dropping or reordering
  anything; a write that can never succeed is found by applying its batch one write at a time, and only it is
  dropped;
* **flushes before acting**: :meth:`drained` (awaited off the loop) returns once every write queued so far is
  stored; the executor awaits it before it starts or stops a process, so that what a restart reads is never
  behind what runs.

:attr:`failing` says since when the thread has failed to store the head of its queue (readiness reports it).

A record the database holds but that cannot be read back is set aside when the copy is loaded, with a
``quarantine`` event each (:mod:`octacloud.control.records`): a deployment's stays stored, as the operator's
input, until that name is deployed again or undeployed; a replica's or a replacement's is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import OperationalError

from octacloud.control.deployments import Deployment, DeploymentSpec, Replica
from octacloud.control.records import OPERATORS, Unreadable
from octacloud.control.store import EventListener, StateStore, unknown_deployment
from octacloud.control.transitions import Transition
from octacloud.core.clock import Clock, SystemClock
from octacloud.core.errors import NotFoundError

log = logging.getLogger("octacloud.controller.store")

_FLEET_KINDS = frozenset({"node"})
RECENT_EVENTS = 2000
"""How many of the newest events are kept in memory for :meth:`ControllerStore.events`."""
BATCH = 100
"""The most queued writes the store thread stores in one transaction (a fleet's deploy queues thousands). SQLite
holds its write lock for the whole transaction: at 500 the meter, which writes to the same file, timed out on
the lock while the cloud deployed 1,000 emulated replicas on a busy machine."""


class ControllerStore:
    """The :class:`~octacloud.control.store.Store` as a :class:`StateStore` behind an in-memory copy and a single
    writing thread (see the module)."""

    def __init__(self, backing: StateStore, clock: Clock | None = None) -> None:
        self.backing = backing
        self.url = backing.url
        self.engine = backing.engine
        self._clock = clock or SystemClock()
        self._deployments = {d.spec.name: d for d in backing.deployments()}
        self._replicas: dict[str, Replica] = {}
        self._of_deployment: dict[str, set[str]] = {}
        """Replica ids by deployment (an index of ``_replicas``)."""
        for r in backing.replicas():
            self._index(r)
        self._transitions = {t.replacement: t for t in backing.transitions()}
        set_aside = [u.key for u in backing.unreadable() if u.kind == "deployment"]
        self._revisions = {name: backing.revisions(name) for name in [*self._deployments, *set_aside]}
        self._unreadable = {(u.kind, u.key): u for u in backing.unreadable()}  # (the revisions' too, now)
        """What the load set aside, by (kind, key): see :mod:`octacloud.control.records`."""
        self._events: collections.deque[dict[str, object]] = collections.deque(
            reversed(backing.events(RECENT_EVENTS)), maxlen=RECENT_EVENTS
        )
        self._events_complete = len(self._events) < RECENT_EVENTS
        """True while the memory holds every event there is (older ones are read from the database)."""
        backing.subscribe(self._heard)  # the controller's events, and those others add to the store directly
        self._removed: dict[str, str] = {}
        self._queue: collections.deque[Callable[[], object]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._alone = 0
        """How many writes at the head of the queue are stored one per transaction (their batch failed)."""
        self.failing: tuple[float, str] | None = None
        """(since, error) while the thread fails to store the head of its queue; None when it stores."""
        self._thread = threading.Thread(target=self._run, name="octacloud-store", daemon=True)
        self._thread.start()
        self._quarantine()

    def _quarantine(self) -> None:
        """One event for each record the load set aside; the controller's own (replicas, replacements) dropped."""
        for u in list(self._unreadable.values()):
            self.add_event("quarantine", u.key, u.message(), deployment=u.deployment, tenant=u.tenant)
            if u.kind not in OPERATORS:
                del self._unreadable[(u.kind, u.key)]
                drop = self.backing.delete_replica if u.kind == "replica" else self.backing.delete_transition
                self._write(functools.partial(drop, u.key))

    def unreadable(self) -> list[Unreadable]:
        """The stored records set aside at load that are still stored (deployments' and revisions')."""
        return sorted(self._unreadable.values(), key=lambda u: (u.kind, u.key))

    # ---- the writing thread ------------------------------------------------------------------------------

    def _write(self, job: Callable[[], object]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the controller's state store is closed")
            self._queue.append(job)
            self._cv.notify_all()

    def _run(self) -> None:
        delay = 0.05
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                jobs = list(itertools.islice(self._queue, 1 if self._alone else BATCH))
                self._busy = True
            try:
                self._store(jobs)
            except OperationalError as exc:  # locked, disk full, connection lost: the same write again, later
                with self._cv:
                    self._busy = False
                    if self.failing is None:
                        self.failing = (self._clock.monotonic(), f"{type(exc).__name__}: {exc}"[:500])
                        log.warning("state store write failed (%s); retrying", exc)
                time.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            except Exception:  # a write that can never succeed: dropped, loudly, so that the rest is stored
                if len(jobs) > 1:  # (somewhere in this batch, none of which is stored: find it)
                    with self._cv:
                        self._alone, self._busy = len(jobs), False
                    continue
                log.exception("state store write failed for good; dropped")
            delay = 0.05
            with self._cv:
                for _ in jobs:
                    self._queue.popleft()
                self._alone = max(0, self._alone - len(jobs))
                self._busy = False
                if self.failing is not None:
                    log.info("state store writes resumed")
                self.failing = None
                self._cv.notify_all()

    def _store(self, jobs: list[Callable[[], object]]) -> None:
        if len(jobs) == 1:
            jobs[0]()
            return
        with self.backing.batch():
            for job in jobs:
                job()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (blocking) until every write queued so far is stored; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    async def drained(self) -> None:
        """Wait, off the event loop, until every write queued so far is stored."""
        with self._cv:
            if not self._queue and not self._busy:
                return
        await asyncio.to_thread(self.flush)

    @property
    def backlog(self) -> int:
        with self._cv:
            return len(self._queue)

    def close(self, timeout: float | None = 10.0) -> None:
        """Store what is queued (waiting up to ``timeout``) and stop the thread; the backing store stays open."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=1.0)

    # ---- deployments -------------------------------------------------------------------------------------

    def put_deployment(self, d: Deployment) -> None:
        d = copy.deepcopy(d)
        self._deployments[d.spec.name] = d
        self._removed.pop(d.spec.name, None)
        self._unreadable.pop(("deployment", d.spec.name), None)
        self._revisions.setdefault(d.spec.name, [])
        self._write(lambda: self.backing.put_deployment(d))

    def get_deployment(self, name: str) -> Deployment:
        d = self._deployments.get(name)
        if d is None:
            raise NotFoundError(unknown_deployment(name, self._unreadable.get(("deployment", name))))
        return copy.deepcopy(d)

    def deployments(self) -> list[Deployment]:
        return [copy.deepcopy(d) for d in sorted(self._deployments.values(), key=lambda d: d.created_at)]

    def delete_deployment(self, name: str) -> None:
        d = self._deployments.pop(name, None)
        unreadable = self._unreadable.pop(("deployment", name), None)
        if d is not None:
            self._removed[name] = d.spec.tenant
        elif unreadable is not None:
            self._removed[name] = unreadable.tenant
        else:
            raise NotFoundError(f"no deployment named {name!r}")
        self._write(lambda: self.backing.delete_deployment(name))

    # ---- replicas ----------------------------------------------------------------------------------------

    def put_replica(self, r: Replica) -> None:
        r = copied(r)
        self._index(r)
        self._write(lambda: self.backing.put_replica(r))

    def _index(self, r: Replica) -> None:
        old = self._replicas.get(r.id)
        if old is not None and old.deployment != r.deployment:
            self._of_deployment.get(old.deployment, set()).discard(r.id)
        self._replicas[r.id] = r
        self._of_deployment.setdefault(r.deployment, set()).add(r.id)

    def delete_replica(self, replica_id: str) -> None:
        """As :meth:`StateStore.delete_replica`: the replacement it was the surge replica of goes with it."""
        replacing = self._transitions.pop(replica_id, None) is not None
        r = self._replicas.pop(replica_id, None)
        if r is not None:
            self._of_deployment.get(r.deployment, set()).discard(replica_id)
        if r is not None or replacing:
            self._write(lambda: self.backing.delete_replica(replica_id))

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        """Every replica (of ``deployment``), in id order; a deployment's are found by its own index, so that asking
        for one deployment's replicas costs what it has, not what the fleet has."""
        if deployment is None:
            return [copied(r) for _, r in sorted(self._replicas.items())]
        return [copied(self._replicas[i]) for i in sorted(self._of_deployment.get(deployment, ()))]

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def peek_replicas(self, deployment: str | None = None) -> list[Replica]:
        """The replicas (of ``deployment``) as stored, not copied, in no order, for readers that only look (routing
        at every change of a replica's state, a pass that finds the few to act on): a copy of each would make every
        look cost what the fleet has. Never modify them; :func:`copied` gives one to change."""
        if deployment is None:
            return list(self._replicas.values())
        return [self._replicas[i] for i in self._of_deployment.get(deployment, ())]

    def waiting_for(self, replica_id: str) -> list[Replica]:
        """The replicas (copies) whose slice waits for ``replica_id`` to leave it (it is in their ``after``): a look
        at each record, a copy only of those."""
        return [copied(r) for _, r in sorted(self._replicas.items()) if replica_id in r.after]

    # ---- replacements in flight ------------------------------------------------------------------------

    def begin_replacement(self, surge: Replica, t: Transition) -> None:
        surge, t = copied(surge), dataclasses.replace(t)
        self._index(surge)
        self._transitions[t.replacement] = t
        self._write(lambda: self.backing.begin_replacement(surge, t))

    def put_transition(self, t: Transition) -> None:
        t = dataclasses.replace(t)
        self._transitions[t.replacement] = t
        self._write(lambda: self.backing.put_transition(t))

    def delete_transition(self, replacement: str) -> None:
        if self._transitions.pop(replacement, None) is not None:
            self._write(lambda: self.backing.delete_transition(replacement))

    def transition(self, replacement: str) -> Transition | None:
        t = self._transitions.get(replacement)
        return None if t is None else dataclasses.replace(t)

    def transitions(self) -> list[Transition]:
        return [dataclasses.replace(t) for _, t in sorted(self._transitions.items())]

    # ---- events ------------------------------------------------------------------------------------------

    def add_event(
        self,
        kind: str,
        subject: str,
        message: str,
        at: float | None = None,
        *,
        deployment: str = "",
        tenant: str = "",
    ) -> None:
        """As :meth:`StateStore.add_event` (stamped with the deployment and tenant the same way, from memory);
        the subscribers are told at once, the row is stored behind."""
        at = time.time() if at is None else at
        if not deployment and kind not in _FLEET_KINDS:
            if subject in self._replicas:
                deployment = self._replicas[subject].deployment
            elif subject in self._deployments or subject in self._removed:
                deployment = subject
        if deployment and not tenant:
            owner = self._deployments.get(deployment)
            tenant = owner.spec.tenant if owner is not None else self._removed.get(deployment, "")
        event: dict[str, object] = {"at": at, "kind": kind, "subject": subject, "message": message,
                                    "deployment": deployment, "tenant": tenant}  # fmt: skip
        self._write(lambda: self.backing.insert_event(at, kind, subject, message, deployment, tenant))
        self.backing.notify(event)  # ``_heard`` keeps it among the recent ones

    def _heard(self, event: dict[str, object]) -> None:
        self._events.append(dict(event))
        if len(self._events) == RECENT_EVENTS:
            self._events_complete = False

    def subscribe(self, listener: EventListener) -> None:
        self.backing.subscribe(listener)

    def events(self, limit: int = 100, *, tenant: str | None = None) -> list[dict[str, object]]:
        """The newest ``limit`` events, newest first; only ``tenant``'s when given."""
        found: list[dict[str, object]] = []
        for e in reversed(self._events):
            if tenant is None or e["tenant"] == tenant:
                found.append(dict(e))
                if len(found) >= limit:
                    return found
        if self._events_complete or self.backlog:  # (while writes are queued the database is behind memory)
            return found
        return self.backing.events(limit, tenant=tenant)  # older than memory holds (a read: never locked out)

    # ---- revisions ---------------------------------------------------------------------------------------

    def add_revision(self, d: Deployment, at: float) -> int:
        history = self._revisions.setdefault(d.spec.name, [])
        unread = [
            int(u.key.rsplit(" ", 1)[1])
            for u in self._unreadable.values()
            if u.kind == "revision" and u.deployment == d.spec.name
        ]  # numbered as the database numbers them
        number = max([history[-1][0] if history else 0, *unread]) + 1
        spec = copy.deepcopy(d.spec)
        history.append((number, spec, d.octants, at))
        d = copy.deepcopy(d)
        self._write(lambda: self.backing.add_revision(d, at))
        return number

    def revisions(self, name: str) -> list[tuple[int, DeploymentSpec, int, float]]:
        return [(n, copy.deepcopy(s), o, at) for n, s, o, at in self._revisions.get(name, [])]

    def delete_revisions(self, name: str) -> None:
        self._revisions.pop(name, None)
        for kind, key in [k for k, u in self._unreadable.items() if k[0] == "revision" and u.deployment == name]:
            del self._unreadable[(kind, key)]
        self._write(lambda: self.backing.delete_revisions(name))


_FIELDS = tuple(f.name for f in dataclasses.fields(Replica))


def copied(r: Replica) -> Replica:
    """A copy of ``r`` to change (its own ``env`` and ``after``): field by field, half what ``dataclasses.replace``
    costs, which a pass over a fleet's replicas pays for each."""
    c = object.__new__(Replica)
    for name in _FIELDS:
        setattr(c, name, getattr(r, name))
    c.env, c.after = dict(r.env), list(r.after)
    return c


def as_controller_store(store: StateStore | ControllerStore, clock: Clock | None = None) -> ControllerStore:
    return store if isinstance(store, ControllerStore) else ControllerStore(store, clock)
