"""Stored records that cannot be read back, set aside rather than stopping the cloud.

Every record is checked by type and range when it is made, but a store can hold one that fails those checks
now: written by an older octacloud before a check existed (a deployment with ``min_replicas`` 1.5), or changed
by hand. Raising on it would stop every start of the cloud and every pass of its controller, for everyone.
Instead the store skips it when it reads (:class:`Quarantine`) and lists it (:class:`Unreadable`); the
controller records a ``quarantine`` event naming the record and why, and the rest of the cloud carries on.

What happens next depends on whose record it is. A deployment or a revision is what an operator asked for: it
stays in the store as written (nothing accepted is lost) until the operator deploys that name again or
undeploys it; meanwhile it has no replicas. A replica or a replacement in flight is the controller's own
bookkeeping: it is dropped, a process it named is stopped as a stray, and its deployment gets a new replica.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from octacloud.core.errors import OctacloudError

log = logging.getLogger("octacloud.store")

T = TypeVar("T")

READ_ERRORS = (OctacloudError, TypeError, ValueError, KeyError, AttributeError, IndexError)
"""What reading one malformed record raises (bad JSON is a ValueError; a wrong field a TypeError)."""

OPERATORS = frozenset({"deployment", "revision"})
"""The kinds of record an operator asked for: kept as stored while they are set aside."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A stored record that fails to read: its kind ("deployment", "revision", "replica", "transition"), key,
    the deployment and tenant it belongs to (as far as its raw text says) and why it fails."""

    kind: str
    key: str
    deployment: str
    tenant: str
    reason: str

    def message(self) -> str:
        """What the ``quarantine`` event says: the record, why, and what to do."""
        what = f"stored {self.kind} {self.key!r} cannot be read ({self.reason}): set aside, the cloud carries on"
        if self.kind == "deployment":
            return (
                f"{what}; it keeps no replicas and is kept as stored until you deploy {self.key!r} again "
                "(which replaces it) or undeploy it"
            )
        if self.kind == "revision":
            return f"{what}; the deployment keeps its other revisions (rollout undo skips this one)"
        return f"{what}; it is dropped (a process it named is stopped) and its deployment gets a new one"


class Quarantine:
    """What a store's reads set aside: :meth:`read` builds a record or, when that raises one of
    :data:`READ_ERRORS`, lists it as :class:`Unreadable` and returns None."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, str], Unreadable] = {}

    def read(self, kind: str, key: str, deployment: str, raw: str, build: Callable[[], T]) -> T | None:
        try:
            record = build()
        except READ_ERRORS as exc:
            why = f"{type(exc).__name__}: {exc}"[:300]
            if (kind, key) not in self._found:
                log.error("stored %s %r cannot be read (%s): set aside", kind, key, why)
            self._found[(kind, key)] = Unreadable(kind, key, deployment, tenant_in(raw), why)
            return None
        self._found.pop((kind, key), None)
        return record

    def get(self, kind: str, key: str) -> Unreadable | None:
        return self._found.get((kind, key))

    def forget(self, kind: str, key: str) -> None:
        """``key`` was replaced or deleted: it is no longer set aside."""
        self._found.pop((kind, key), None)

    def found(self) -> list[Unreadable]:
        return sorted(self._found.values(), key=lambda u: (u.kind, u.key))


def tenant_in(raw: str) -> str:
    """The tenant a record's raw JSON names ('' when it names none, or is not JSON)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return ""
    tenant = data.get("tenant") if isinstance(data, dict) else None
    return tenant if isinstance(tenant, str) and tenant.isascii() and tenant.isprintable() else ""
