"""The controller's events: what the operator reads (``octacloud events``, ``up``'s log, the dashboard), each
stamped with the deployment and tenant it concerns so that a tenant reads only its own."""

from __future__ import annotations

from octacloud.control.deployments import Replica
from octacloud.control.store import Store
from octacloud.core.errors import NotFoundError


class EventLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def fleet(self, subject: str, message: str) -> None:
        """About a node or card (admins only)."""
        self.store.add_event("node", subject, message)

    def record(self, kind: str, subject: str, message: str, deployment: str = "") -> None:
        """About ``subject`` of ``deployment`` (the store stamps its tenant, even once it was removed)."""
        self.store.add_event(kind, subject, message, deployment=deployment)

    def replica(self, kind: str, r: Replica, message: str, tenant: str = "") -> None:
        """About replica ``r`` (``tenant``: its deployment's, when the caller knows it already)."""
        self.store.add_event(kind, r.id, message, deployment=r.deployment, tenant=tenant)

    def tenant(self, deployment: str) -> str:
        """The tenant that owns ``deployment`` ('' for none, or one removed)."""
        if not deployment:
            return ""
        try:
            return self.store.get_deployment(deployment).spec.tenant
        except NotFoundError:
            return ""
