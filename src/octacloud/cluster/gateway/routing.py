"""Routing policy: which replica of a deployment gets the next request.

The mechanism (connections, retries, counting) lives in the proxies; this module only chooses. The default
is the power of two choices on outstanding requests (as Ray Serve's router): sample two ready replicas, send
to the one with fewer requests in flight. It balances as well as least-outstanding with O(1) work and no
herding on a replica that just became free.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Endpoint:
    """A ready replica as the gateway sees it."""

    replica_id: str
    host: str
    http_port: int
    grpc_port: int
    outstanding: int = 0
    failures: int = 0
    """Consecutive transport failures; the endpoint is skipped once it reaches the limit."""


@dataclass(slots=True)
class DeploymentCounters:
    """What the gateway measured for one deployment (read by the autoscaler and the meter)."""

    requests: int = 0
    failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    latency_us_total: int = 0
    outstanding: int = 0


@dataclass(slots=True)
class TenantTraffic:
    """What the gateway carried for one calling tenant to one deployment (read by the meter)."""

    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True, slots=True)
class Owner:
    """Who owns a deployment, and whether other tenants may use it."""

    tenant: str
    published: bool = False


MAX_CONSECUTIVE_FAILURES = 3


@dataclass(slots=True)
class RouteTable:
    """Deployment name → its ready endpoints. Replaced wholesale by the controller; read per request."""

    routes: dict[str, list[Endpoint]] = field(default_factory=dict)
    counters: dict[str, DeploymentCounters] = field(default_factory=dict)
    owners: dict[str, Owner] = field(default_factory=dict)
    """Deployment name → owner, set by the controller; the front ends hide deployments a caller may not see."""
    traffic: dict[tuple[str, str], TenantTraffic] = field(default_factory=dict)
    """(calling tenant, deployment) → traffic: usage attributed to whoever sent it."""
    rng: random.Random = field(default_factory=random.Random)

    def update(self, deployment: str, endpoints: Iterable[Endpoint]) -> None:
        """Set the ready endpoints of ``deployment``, keeping the live counts of endpoints that stay."""
        old = {e.replica_id: e for e in self.routes.get(deployment, [])}
        new: list[Endpoint] = []
        for e in endpoints:
            kept = old.get(e.replica_id)
            if kept is not None and (kept.host, kept.http_port, kept.grpc_port) == (e.host, e.http_port, e.grpc_port):
                new.append(kept)
            else:
                new.append(e)
        self.routes[deployment] = new
        self.counters.setdefault(deployment, DeploymentCounters())

    def remove(self, deployment: str) -> None:
        self.routes.pop(deployment, None)
        self.owners.pop(deployment, None)

    def drop_endpoint(self, replica_id: str) -> None:
        """Stop routing to a replica at once (it died or is being stopped)."""
        for name, endpoints in self.routes.items():
            self.routes[name] = [e for e in endpoints if e.replica_id != replica_id]

    def healthy(self, deployment: str, exclude: Sequence[str] = ()) -> list[Endpoint]:
        """The endpoints of ``deployment`` below the failure limit, except the replicas in ``exclude``."""
        return [
            e
            for e in self.routes.get(deployment, ())
            if e.failures < MAX_CONSECUTIVE_FAILURES and e.replica_id not in exclude
        ]

    def choose(self, deployment: str, exclude: Sequence[str] = ()) -> Endpoint | None:
        """Power of two choices among healthy endpoints not in ``exclude``; None when there is none."""
        healthy = self.healthy(deployment, exclude)
        if not healthy:
            return None
        if len(healthy) == 1:
            return healthy[0]
        a, b = self.rng.sample(healthy, 2)
        return a if a.outstanding <= b.outstanding else b

    def tenant_traffic(self, tenant: str, deployment: str) -> TenantTraffic:
        t = self.traffic.get((tenant, deployment))
        if t is None:
            t = self.traffic[(tenant, deployment)] = TenantTraffic()
        return t

    def counter(self, deployment: str) -> DeploymentCounters:
        c = self.counters.get(deployment)
        if c is None:
            c = self.counters[deployment] = DeploymentCounters()
        return c
