"""Priority classes: the only way a tenant's deployment gets a scheduling priority.

A priority decides who preempts whom, so it is the admin's to hand out, as Kubernetes' PriorityClass is:

- an admin defines classes (name → integer priority, a description, at most one cloud-wide default);
- an admin grants classes to tenants, one of them the tenant's default;
- a tenant deploys with ``priority_class`` naming a class granted to it (or the cloud-wide default), or
  without one: its default class, else the cloud-wide default, else priority 0. A raw ``priority`` from a
  tenant is refused; an admin may name any class or give a raw priority.

Deployments keep the priority they were given: changing or revoking a class affects the next deploy only.
Classes and grants live in the state database beside the tenants (:mod:`.keys`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Boolean, Float, Integer, String, Text, delete, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from octacloud.core import fields
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError
from octacloud.core.fields import CLASS_NAME, CLASS_RULE, PRIORITY_RANGE
from octacloud.tenancy.keys import Principal


class PriorityNotGrantedError(OctacloudError):
    """A tenant asked for a priority it was not granted (a raw priority, or a class not granted to it)."""


@dataclass(frozen=True, slots=True)
class PriorityClass:
    name: str
    priority: int
    description: str = ""
    global_default: bool = False
    """The class of deployments whose tenant has no default class of its own (at most one)."""


@dataclass(frozen=True, slots=True)
class Grant:
    tenant: str
    priority_class: str
    default: bool = False


class _Base(DeclarativeBase):
    pass


class _ClassRow(_Base):
    __tablename__ = "priority_classes"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer)
    description: Mapped[str] = mapped_column(Text, default="")
    global_default: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)


class _GrantRow(_Base):
    __tablename__ = "priority_grants"
    tenant: Mapped[str] = mapped_column(String(32), primary_key=True)
    priority_class: Mapped[str] = mapped_column(String(32), primary_key=True)
    is_default: Mapped[bool] = mapped_column(Boolean, default=False)


class PriorityClasses:
    """Classes and grants in the state database, and the one rule that turns a deploy request into a priority."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        self.clock = clock
        _Base.metadata.create_all(engine)
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # ---- classes -----------------------------------------------------------------------------------------

    def define(self, name: str, priority: int, description: str = "", global_default: bool = False) -> PriorityClass:
        """Create or change a class (admin). Making it the cloud-wide default unmarks the previous one."""
        fields.name(name, "priority class name", CLASS_NAME, CLASS_RULE)
        fields.whole(priority, "priority", *PRIORITY_RANGE)
        fields.text(description, "description", 200)
        fields.flag(global_default, "global_default")
        with self._tx() as s:
            if global_default:
                for other in s.scalars(select(_ClassRow).where(_ClassRow.global_default)):
                    other.global_default = False
            row = s.get(_ClassRow, name)
            if row is None:
                row = _ClassRow(name=name, created_at=self.clock.time())
                s.add(row)
            row.priority, row.description, row.global_default = priority, description, bool(global_default)
            return _class(row)

    def get(self, name: str) -> PriorityClass:
        with self._tx() as s:
            row = s.get(_ClassRow, name)
            if row is None:
                raise NotFoundError(f"no priority class named {name!r}")
            return _class(row)

    def classes(self) -> list[PriorityClass]:
        with self._tx() as s:
            return [_class(r) for r in s.scalars(select(_ClassRow).order_by(_ClassRow.priority.desc()))]

    def remove(self, name: str) -> None:
        """Delete a class and its grants (deployments that have its priority keep it)."""
        with self._tx() as s:
            row = s.get(_ClassRow, name)
            if row is None:
                raise NotFoundError(f"no priority class named {name!r}")
            s.delete(row)
            s.execute(delete(_GrantRow).where(_GrantRow.priority_class == name))

    # ---- grants ------------------------------------------------------------------------------------------

    def grant(self, tenant: str, name: str, default: bool = False) -> Grant:
        """Let ``tenant`` deploy with class ``name``; ``default`` makes it the class of its unnamed deploys."""
        with self._tx() as s:
            if s.get(_ClassRow, name) is None:
                raise NotFoundError(f"no priority class named {name!r}")
            if default:
                for other in s.scalars(select(_GrantRow).where(_GrantRow.tenant == tenant)):
                    other.is_default = False
            row = s.get(_GrantRow, (tenant, name))
            if row is None:
                row = _GrantRow(tenant=tenant, priority_class=name)
                s.add(row)
            row.is_default = bool(default)
            return Grant(tenant, name, row.is_default)

    def revoke(self, tenant: str, name: str) -> None:
        with self._tx() as s:
            row = s.get(_GrantRow, (tenant, name))
            if row is None:
                raise NotFoundError(f"tenant {tenant!r} has no grant of priority class {name!r}")
            s.delete(row)

    def grants(self, tenant: str | None = None) -> list[Grant]:
        with self._tx() as s:
            q = select(_GrantRow).order_by(_GrantRow.tenant, _GrantRow.priority_class)
            if tenant is not None:
                q = q.where(_GrantRow.tenant == tenant)
            return [Grant(r.tenant, r.priority_class, r.is_default) for r in s.scalars(q)]

    # ---- the rule ----------------------------------------------------------------------------------------

    def resolve(self, caller: Principal, tenant: str, requested: str | None, raw: int | None) -> tuple[str, int]:
        """The (class name, priority) of a deployment ``caller`` asks for on behalf of ``tenant``.

        Raises :class:`PriorityNotGrantedError` when a tenant gives a raw priority or names a class not granted
        to it, and :class:`NotFoundError` for an admin naming a class that does not exist (a tenant gets the
        same refusal for a missing class as for one not granted, so names of classes are not revealed)."""
        if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool)):
            raise InvalidSpecError(f"priority must be a whole number, got {raw!r}")
        if requested is not None and not isinstance(requested, str):
            raise InvalidSpecError(f"priority_class must be a class name, got {requested!r}")
        if caller.is_admin:
            if requested:
                if raw is not None:
                    raise InvalidSpecError("give priority_class or priority, not both")
                return requested, self.get(requested).priority
            if raw is not None:
                return "", raw
        elif raw is not None:
            raise PriorityNotGrantedError(
                "a tenant may not set 'priority': name a priority class granted to it in 'priority_class' "
                "(see them with: octacloud priority-class list), or leave both out for its default"
            )
        grants = self.grants(tenant)
        with self._tx() as s:
            classes = {r.name: _class(r) for r in s.scalars(select(_ClassRow))}
        cloud_default = next((c for c in classes.values() if c.global_default), None)
        if requested:
            granted = any(g.priority_class == requested for g in grants) or (
                cloud_default is not None and cloud_default.name == requested
            )
            if not caller.is_admin and (not granted or requested not in classes):
                raise PriorityNotGrantedError(
                    f"priority class {requested!r} is not granted to tenant {tenant!r}; "
                    "ask an admin to grant it (octacloud tenant grant)"
                )
            return requested, classes[requested].priority
        default = next((classes[g.priority_class] for g in grants if g.default and g.priority_class in classes), None)
        chosen = default or cloud_default
        return (chosen.name, chosen.priority) if chosen is not None else ("", 0)


def _class(row: _ClassRow) -> PriorityClass:
    return PriorityClass(row.name, row.priority, row.description, row.global_default)
