"""The state store: deployments, replicas and events, in SQLite by default (PostgreSQL by URL).

The controller is the only writer. Everything it needs to come back after a restart lives here: the
deployments it was asked for and the replicas it launched (their slices, PIDs and ports), so that a restarted
controller adopts live replicas instead of starting them twice.

:class:`Store` is the contract; :class:`StateStore` keeps it in the database, and the controller's
:class:`~octacloud.control.controller.state.ControllerStore` keeps it in memory in front of a ``StateStore``
(written behind, in order). Whoever only reads or records (the admin API, the dashboard, the meter, the CLI)
is given a ``Store``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from functools import partial
from pathlib import Path
from typing import Protocol

from sqlalchemy import Float, Integer, String, Text, inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.records import Quarantine, Unreadable, tenant_in
from octacloud.control.transitions import Transition
from octacloud.core.errors import NotFoundError
from octacloud.database import open_engine, private_folder, sqlite_url

log = logging.getLogger("octacloud.store")

EventListener = Callable[[dict[str, object]], None]
"""Called with each event once it is stored (``at``, ``kind``, ``subject``, ``message``, ``deployment``,
``tenant``); must not block."""

_FLEET_KINDS = frozenset({"node"})
"""Event kinds about the fleet, not a deployment: admins only, whatever the subject is named."""


class _Base(DeclarativeBase):
    pass


class _DeploymentRow(_Base):
    __tablename__ = "deployments"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    spec: Mapped[str] = mapped_column(Text)
    replicas: Mapped[int] = mapped_column(Integer)
    octants: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    generation: Mapped[int] = mapped_column(Integer)


class _ReplicaRow(_Base):
    __tablename__ = "replicas"
    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    deployment: Mapped[str] = mapped_column(String(64), index=True)
    data: Mapped[str] = mapped_column(Text)


class _EventRow(_Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text)
    deployment: Mapped[str] = mapped_column(String(64), default="")
    tenant: Mapped[str] = mapped_column(String(64), default="", index=True)


class _RevisionRow(_Base):
    """Every spec a deployment was given, numbered from 1: what ``rollout undo`` goes back to."""

    __tablename__ = "revisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(String(64), index=True)
    revision: Mapped[int] = mapped_column(Integer)
    spec: Mapped[str] = mapped_column(Text)
    octants: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)


class _TransitionRow(_Base):
    """A replacement in flight (a move or a rolling-update step), keyed by its replacement replica."""

    __tablename__ = "transitions"
    replacement: Mapped[str] = mapped_column(String(96), primary_key=True)
    source: Mapped[str] = mapped_column(String(96))
    kind: Mapped[str] = mapped_column(String(16))
    deployment: Mapped[str] = mapped_column(String(64))
    phase: Mapped[str] = mapped_column(String(16))
    data: Mapped[str] = mapped_column(Text)


class Store(Protocol):
    """Deployments, replicas, replacements in flight, events and revisions: what the control plane keeps across
    restarts. An implementation guarantees:

    * **copies**: every read returns fresh objects; changing one changes nothing stored until it is put back;
    * **keys**: a deployment is keyed by its name, a replica by its id, a replacement by its replacement replica's
      id; ``put_*`` replaces the record with that key. ``get_deployment`` and ``delete_deployment`` of a missing
      name raise :class:`~octacloud.core.errors.NotFoundError` naming it; the other deletes of a missing key do
      nothing; ``transition`` of a missing key is None;
    * **order**: ``deployments()`` oldest first (``created_at``); ``replicas()`` and ``transitions()`` by key;
      ``events()`` newest first; ``revisions()`` oldest first, numbered from 1 per deployment;
    * **replacements**: ``begin_replacement`` stores a surge replica and its transition together (both or neither);
      deleting a replica deletes the transition whose replacement it is (a transition never outlives it);
    * **events**: ``add_event`` stamps an event with the deployment and tenant it concerns (as
      :meth:`StateStore.add_event` says) and tells every subscriber; ``events(tenant=...)`` selects by that stamp;
    * **read your writes**: what a writer puts it reads back at once, and the database receives its writes in the
      order they were made (an implementation may store them a moment later, never out of order or not at all);
    * **unreadable records**: a stored record that no longer passes its checks is skipped by every read (a
      ``get_deployment`` of it raises NotFoundError saying so) and listed by ``unreadable()``; it stays stored
      until a ``put_*`` or delete with its key replaces or removes it (:mod:`octacloud.control.records`).
    """

    url: str

    def put_deployment(self, d: Deployment) -> None: ...
    def get_deployment(self, name: str) -> Deployment: ...
    def deployments(self) -> list[Deployment]: ...
    def delete_deployment(self, name: str) -> None: ...
    def put_replica(self, r: Replica) -> None: ...
    def delete_replica(self, replica_id: str) -> None: ...
    def replicas(self, deployment: str | None = None) -> list[Replica]: ...
    def begin_replacement(self, surge: Replica, t: Transition) -> None: ...
    def put_transition(self, t: Transition) -> None: ...
    def delete_transition(self, replacement: str) -> None: ...
    def transition(self, replacement: str) -> Transition | None: ...
    def transitions(self) -> list[Transition]: ...
    def add_event(
        self, kind: str, subject: str, message: str, at: float | None = None, *, deployment: str = "", tenant: str = ""
    ) -> None: ...
    def subscribe(self, listener: EventListener) -> None: ...
    def events(self, limit: int = 100, *, tenant: str | None = None) -> list[dict[str, object]]: ...
    def add_revision(self, d: Deployment, at: float) -> int: ...
    def revisions(self, name: str) -> list[tuple[int, DeploymentSpec, int, float]]: ...
    def delete_revisions(self, name: str) -> None: ...
    def unreadable(self) -> list[Unreadable]: ...


class StateStore:
    """The :class:`Store` in a database (SQLAlchemy): SQLite by default, PostgreSQL by URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = open_engine(url)
        _Base.metadata.create_all(self.engine)
        _add_missing_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._removed: dict[str, str] = {}  # deployment → tenant, for the events of its removal
        self._listeners: list[EventListener] = []
        self._batch = threading.local()  # .session: the transaction of this thread's batch(), if one is open
        self._quarantine = Quarantine()

    @classmethod
    def at(cls, path: Path) -> StateStore:
        private_folder(path.parent)
        return cls(sqlite_url(path))

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        outer: Session | None = getattr(self._batch, "session", None)
        if outer is not None:
            yield outer
            return
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Every call this thread makes inside the block in one transaction: all of it stored at the end, or none
        of it (an error rolls the lot back). One commit for many rows is what lets a writer keep up with a fleet."""
        with self._sessions.begin() as session:
            self._batch.session = session
            try:
                yield
            finally:
                self._batch.session = None

    # ---- deployments -------------------------------------------------------------------------------------

    def put_deployment(self, d: Deployment) -> None:
        with self._tx() as s:
            s.merge(
                _DeploymentRow(
                    name=d.spec.name,
                    spec=json.dumps(asdict(d.spec)),
                    replicas=d.replicas,
                    octants=d.octants,
                    created_at=d.created_at,
                    generation=d.generation,
                )
            )
        self._quarantine.forget("deployment", d.spec.name)

    def get_deployment(self, name: str) -> Deployment:
        with self._tx() as s:
            row = s.get(_DeploymentRow, name)
            d = None if row is None else self._deployment(row)
        if d is None:
            raise NotFoundError(unknown_deployment(name, self._quarantine.get("deployment", name)))
        return d

    def deployments(self) -> list[Deployment]:
        with self._tx() as s:
            rows = s.scalars(select(_DeploymentRow).order_by(_DeploymentRow.created_at))
            return [d for d in map(self._deployment, rows) if d is not None]

    def delete_deployment(self, name: str) -> None:
        with self._tx() as s:
            row = s.get(_DeploymentRow, name)
            if row is None:
                raise NotFoundError(f"no deployment named {name!r}")
            self._removed[name] = tenant_in(row.spec)
            s.delete(row)
        self._quarantine.forget("deployment", name)

    def _deployment(self, row: _DeploymentRow) -> Deployment | None:
        return self._quarantine.read("deployment", row.name, row.name, row.spec, lambda: _deployment(row))

    # ---- replicas ----------------------------------------------------------------------------------------

    def put_replica(self, r: Replica) -> None:
        data = asdict(r)
        data["state"] = r.state.value
        with self._tx() as s:
            s.merge(_ReplicaRow(id=r.id, deployment=r.deployment, data=json.dumps(data)))
        self._quarantine.forget("replica", r.id)

    def delete_replica(self, replica_id: str) -> None:
        """Forget a replica, and the replacement it was the surge replica of (one transaction)."""
        with self._tx() as s:
            for row in (s.get(_ReplicaRow, replica_id), s.get(_TransitionRow, replica_id)):
                if row is not None:
                    s.delete(row)
        self._quarantine.forget("replica", replica_id)
        self._quarantine.forget("transition", replica_id)

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        with self._tx() as s:
            q = select(_ReplicaRow).order_by(_ReplicaRow.id)
            if deployment is not None:
                q = q.where(_ReplicaRow.deployment == deployment)
            read = (self._quarantine.read("replica", row.id, row.deployment, row.data, partial(_replica, row))
                    for row in s.scalars(q))  # fmt: skip
            return [r for r in read if r is not None]

    # ---- replacements in flight ------------------------------------------------------------------------

    def begin_replacement(self, surge: Replica, t: Transition) -> None:
        """Store a surge replica and the transition it starts, in one transaction (both or neither)."""
        data = asdict(surge)
        data["state"] = surge.state.value
        with self._tx() as s:
            s.merge(_ReplicaRow(id=surge.id, deployment=surge.deployment, data=json.dumps(data)))
            s.merge(_transition_row(t))
        self._quarantine.forget("replica", surge.id)
        self._quarantine.forget("transition", t.replacement)

    def put_transition(self, t: Transition) -> None:
        with self._tx() as s:
            s.merge(_transition_row(t))
        self._quarantine.forget("transition", t.replacement)

    def delete_transition(self, replacement: str) -> None:
        with self._tx() as s:
            row = s.get(_TransitionRow, replacement)
            if row is not None:
                s.delete(row)
        self._quarantine.forget("transition", replacement)

    def transition(self, replacement: str) -> Transition | None:
        with self._tx() as s:
            row = s.get(_TransitionRow, replacement)
            return None if row is None else self._transition(row)

    def transitions(self) -> list[Transition]:
        with self._tx() as s:
            rows = s.scalars(select(_TransitionRow).order_by(_TransitionRow.replacement))
            return [t for t in map(self._transition, rows) if t is not None]

    def _transition(self, row: _TransitionRow) -> Transition | None:
        return self._quarantine.read("transition", row.replacement, row.deployment, row.data,
                                     lambda: _transition(row))  # fmt: skip

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
        """Record an event about ``subject`` (a replica, deployment or node), with the deployment and tenant it
        concerns, and tell the subscribers. Callers that know the owner pass it; otherwise the event is stamped
        with the deployment and tenant the subject belongs to now (a replica's row, else a deployment's, else the
        deployment just removed under that name), so that a tenant's events are selected by owner, never by
        matching names (one tenant's name may be a prefix of another's). Fleet events (``node``) have none."""
        at = time.time() if at is None else at
        self.notify(self.insert_event(at, kind, subject, message, deployment, tenant))

    def insert_event(
        self, at: float, kind: str, subject: str, message: str, deployment: str, tenant: str
    ) -> dict[str, object]:
        """Store an event (stamped as :meth:`add_event` says) without telling the subscribers; returns it."""
        with self._tx() as s:
            if not deployment and kind not in _FLEET_KINDS:
                replica = s.get(_ReplicaRow, subject)
                if replica is not None:
                    deployment = replica.deployment
                elif s.get(_DeploymentRow, subject) is not None or subject in self._removed:
                    deployment = subject
            if deployment and not tenant:
                owner = s.get(_DeploymentRow, deployment)
                tenant = tenant_in(owner.spec) if owner is not None else self._removed.get(deployment, "")
            s.add(_EventRow(at=at, kind=kind, subject=subject, message=message, deployment=deployment, tenant=tenant))
        return {"at": at, "kind": kind, "subject": subject, "message": message, "deployment": deployment,
                "tenant": tenant}  # fmt: skip

    def notify(self, event: dict[str, object]) -> None:
        """Tell the subscribers about a stored event."""
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a failing subscriber must not fail the controller's step
                log.exception("event listener failed")

    def subscribe(self, listener: EventListener) -> None:
        """Call ``listener`` with every event stored from now on (``octacloud up`` logs them)."""
        self._listeners.append(listener)

    def events(self, limit: int = 100, *, tenant: str | None = None) -> list[dict[str, object]]:
        """The newest ``limit`` events, newest first; only ``tenant``'s when given."""
        with self._tx() as s:
            q = select(_EventRow)
            if tenant is not None:
                q = q.where(_EventRow.tenant == tenant)
            rows = s.scalars(q.order_by(_EventRow.id.desc()).limit(limit))
            return [
                {
                    "at": r.at,
                    "kind": r.kind,
                    "subject": r.subject,
                    "message": r.message,
                    "deployment": r.deployment or "",
                    "tenant": r.tenant or "",
                }
                for r in rows
            ]

    # ---- revisions ---------------------------------------------------------------------------------------

    def add_revision(self, d: Deployment, at: float) -> int:
        """Record ``d``'s spec as its deployment's next revision; returns the revision's number."""
        with self._tx() as s:
            last = s.scalars(
                select(_RevisionRow.revision)
                .where(_RevisionRow.deployment == d.spec.name)
                .order_by(_RevisionRow.revision.desc())
                .limit(1)
            ).first()
            number = (last or 0) + 1
            s.add(
                _RevisionRow(
                    deployment=d.spec.name, revision=number, spec=json.dumps(asdict(d.spec)), octants=d.octants, at=at
                )
            )
            return number

    def revisions(self, name: str) -> list[tuple[int, DeploymentSpec, int, float]]:
        """``(revision, spec, octants, at)`` of deployment ``name``, oldest first."""
        with self._tx() as s:
            rows = s.scalars(
                select(_RevisionRow).where(_RevisionRow.deployment == name).order_by(_RevisionRow.revision)
            )
            read = (self._quarantine.read("revision", f"{name} revision {row.revision}", name, row.spec,
                                          partial(_revision, row)) for row in rows)  # fmt: skip
            return [r for r in read if r is not None]

    def delete_revisions(self, name: str) -> None:
        with self._tx() as s:
            for row in s.scalars(select(_RevisionRow).where(_RevisionRow.deployment == name)):
                s.delete(row)
                self._quarantine.forget("revision", f"{name} revision {row.revision}")

    def unreadable(self) -> list[Unreadable]:
        """The records the reads so far have set aside (:mod:`octacloud.control.records`)."""
        return self._quarantine.found()

    def close(self) -> None:
        self.engine.dispose()


def _add_missing_columns(engine: Engine) -> None:
    """Bring a store written by an older octacloud up to date: columns added since are created, empty."""
    have = {c["name"] for c in inspect(engine).get_columns("events")}
    with engine.begin() as connection:
        for column in ("deployment", "tenant"):
            if column not in have:
                connection.execute(text(f"ALTER TABLE events ADD COLUMN {column} VARCHAR(64) DEFAULT ''"))


def unknown_deployment(name: str, unreadable: Unreadable | None) -> str:
    """What a lookup of a deployment that is not there says (one that is set aside: why, and what to do)."""
    if unreadable is None:
        return f"no deployment named {name!r}"
    return f"deployment {name!r} is set aside: {unreadable.message()}"


def _deployment(row: _DeploymentRow) -> Deployment:
    return Deployment(
        spec=DeploymentSpec(**json.loads(row.spec)),
        replicas=row.replicas,
        octants=row.octants,
        created_at=row.created_at,
        generation=row.generation,
    )


def _revision(row: _RevisionRow) -> tuple[int, DeploymentSpec, int, float]:
    return row.revision, DeploymentSpec(**json.loads(row.spec)), row.octants, row.at


def _transition_row(t: Transition) -> _TransitionRow:
    where = {"node": t.node, "gpus": list(t.gpus), "milli_per_gpu": t.milli_per_gpu}
    return _TransitionRow(replacement=t.replacement, source=t.source, kind=t.kind, deployment=t.deployment,
                          phase=t.phase, data=json.dumps(where))  # fmt: skip


def _transition(row: _TransitionRow) -> Transition:
    where = json.loads(row.data)
    return Transition(row.replacement, row.source, row.kind, row.deployment, row.phase, where["node"],
                      tuple(where["gpus"]), where["milli_per_gpu"])  # fmt: skip


_REPLICA_FIELDS = {f.name for f in fields(Replica)}


def _replica(row: _ReplicaRow) -> Replica:
    data = {k: v for k, v in json.loads(row.data).items() if k in _REPLICA_FIELDS}
    data["state"] = ReplicaState(data["state"])
    data["gpus"] = tuple(data["gpus"])
    return Replica(**data)
