"""What gateway worker processes share with the main process, as plain data (no I/O here; ``gateway.feed`` moves it).

- **Routes.** The main process's route table (written by the controller) is copied whole into a snapshot
  (:func:`route_snapshot`) whenever it changes; a worker applies it to its own table (:func:`apply_snapshot`)
  so that endpoints that stay keep their live counts and their outlier state. Outlier *ejection* is each
  worker's own (as each Envoy ejects on what it sees); *readmission* by the controller's readiness probe is
  sent to every worker at once.
- **Traffic.** A worker's front ends count into its own table; :class:`CounterTracker` takes what was counted
  since the last push as a delta, and :class:`CounterMerger` adds a worker's deltas into the main table, which
  the meter and the autoscaler read as before. Deltas are added once each (a delta is taken after it was
  written), so a worker killed with -9 loses at most what it counted since its last push and nothing is ever
  counted twice. Requests in flight are a level: each worker's count replaces its previous one, and leaves
  with the worker.
- **Rate limits.** Each of N workers enforces 1/N of every tenant's rate and burst (:class:`SharedRateLimiter`):
  together they never admit more than the tenant's rate (plus at most N-1 requests of rounding in the burst),
  and a tenant whose connections all land on one worker gets 1/N of its rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from octacloud.cluster.auth.keys import Quota
from octacloud.cluster.auth.limits import RateLimiter, TokenBucket
from octacloud.cluster.gateway.routing import (
    GONE_MEMORY_S,
    DeploymentCounters,
    Endpoint,
    Owner,
    RouteTable,
    TenantTraffic,
)
from octacloud.core.clock import Clock

Snapshot = dict[str, Any]
"""``{"routes": {deployment: [[replica_id, host, http_port, grpc_port], ...]}, "owners": {deployment: [tenant,
published]}, "inflight": {deployment: per_replica}, "gone": [replica_id, ...]}``: JSON-ready. ``gone``: the
replicas found dead lately (``RouteTable.gone``), whose exchanges in flight a worker ends at once."""


class ShareError(ValueError):
    """A message between the main process and a worker that does not have the expected shape."""


def route_snapshot(table: RouteTable) -> Snapshot:
    """What a worker needs of the main route table to route and to hide deployments (JSON-ready)."""
    return {
        "routes": {
            name: [[e.replica_id, e.host, e.http_port, e.grpc_port] for e in endpoints]
            for name, endpoints in table.routes.items()
        },
        "owners": {name: [o.tenant, o.published] for name, o in table.owners.items()},
        "inflight": dict(table.inflight_per_replica),
        "gone": [rid for rid, at in table.gone.items() if table.now() - at <= GONE_MEMORY_S],
    }


def apply_snapshot(table: RouteTable, snapshot: Snapshot) -> None:
    """Make ``table``'s routes, owners and in-flight bounds those of ``snapshot``; raises ShareError when malformed
    (then ``table`` is unchanged)."""
    routes = _mapping(snapshot, "routes")
    owners = _mapping(snapshot, "owners")
    inflight = _mapping(snapshot, "inflight")
    parsed: dict[str, list[Endpoint]] = {}
    for name, endpoints in routes.items():
        if not isinstance(endpoints, list):
            raise ShareError(f"routes of {name!r} are not a list")
        parsed[_text(name)] = [_endpoint(e) for e in endpoints]
    new_owners: dict[str, Owner] = {}
    for name, owner in owners.items():
        if not (isinstance(owner, list) and len(owner) == 2 and isinstance(owner[1], bool)):
            raise ShareError(f"owner of {name!r} is not [tenant, published]")
        new_owners[_text(name)] = Owner(_text(owner[0]), owner[1])
    new_inflight = {_text(name): _count(n) for name, n in inflight.items()}
    gone = snapshot.get("gone", [])  # absent in a snapshot of an older main process
    if not (isinstance(gone, list) and all(isinstance(g, str) for g in gone)):
        raise ShareError("gone is not a list of replica ids")
    for replica_id in gone:
        if replica_id not in table.gone:  # found dead since the last snapshot: end what is in flight to it
            table.drop_endpoint(replica_id, gone=True)
    for name in [n for n in table.routes if n not in parsed]:
        table.remove(name)
    for name, endpoints in parsed.items():
        table.update(name, endpoints)
    table.owners.clear()
    table.owners.update(new_owners)
    table.inflight_per_replica.clear()
    table.inflight_per_replica.update(new_inflight)


def _endpoint(item: Any) -> Endpoint:
    if not (isinstance(item, list) and len(item) == 4):
        raise ShareError("an endpoint is [replica_id, host, http_port, grpc_port]")
    return Endpoint(_text(item[0]), _text(item[1]), _count(item[2]), _count(item[3]))


def _mapping(data: Any, key: str) -> Mapping[str, Any]:
    value = data.get(key) if isinstance(data, Mapping) else None
    if not isinstance(value, Mapping):
        raise ShareError(f"{key!r} is missing or not an object")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ShareError(f"expected a string, got {type(value).__name__}")
    return value


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShareError(f"expected a non-negative integer, got {value!r}")
    return value


_SUMMED = ("requests", "failures", "bytes_in", "bytes_out", "latency_us_total", "shed")
"""DeploymentCounters fields that only grow (pushed as deltas); ``outstanding`` is a level."""
_TRAFFIC = ("requests", "bytes_in", "bytes_out")


@dataclass(slots=True)
class CounterTracker:
    """A worker's side: what its table counted since the last :meth:`take` (JSON-ready), or None when nothing."""

    table: RouteTable
    _sent_counters: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _sent_traffic: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    _sent_outstanding: dict[str, int] = field(default_factory=dict)

    def take(self) -> dict[str, Any] | None:
        deployments: dict[str, list[int]] = {}
        outstanding: dict[str, int] = {}
        for name, c in self.table.counters.items():
            now = tuple(getattr(c, f) for f in _SUMMED)
            was = self._sent_counters.get(name, (0,) * len(_SUMMED))
            if now != was:
                deployments[name] = [a - b for a, b in zip(now, was, strict=True)]
                self._sent_counters[name] = now
            if c.outstanding != self._sent_outstanding.get(name, 0):
                outstanding[name] = self._sent_outstanding[name] = c.outstanding
        traffic: list[list[Any]] = []
        for (tenant, deployment), t in self.table.traffic.items():
            now = tuple(getattr(t, f) for f in _TRAFFIC)
            was = self._sent_traffic.get((tenant, deployment), (0,) * len(_TRAFFIC))
            if now != was:
                traffic.append([tenant, deployment, *(a - b for a, b in zip(now, was, strict=True))])
                self._sent_traffic[(tenant, deployment)] = now
        if not (deployments or outstanding or traffic):
            return None
        return {"deployments": deployments, "outstanding": outstanding, "traffic": traffic}


@dataclass(slots=True)
class CounterMerger:
    """The main process's side: adds each worker's deltas into the main table (read by the meter and autoscaler)."""

    table: RouteTable
    _outstanding: dict[int, dict[str, int]] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)
    """Worker index → requests it carried (billed traffic), since the main process started."""

    def add(self, worker: int, delta: Mapping[str, Any]) -> None:
        """Add one pushed delta; raises ShareError (adding nothing) when it is malformed."""
        deployments = _mapping(delta, "deployments")
        outstanding = _mapping(delta, "outstanding")
        traffic = delta.get("traffic")
        if not isinstance(traffic, list):
            raise ShareError("'traffic' is missing or not a list")
        counts = {_text(name): _counts(values, len(_SUMMED)) for name, values in deployments.items()}
        levels = {_text(name): _count(n) for name, n in outstanding.items()}
        rows: list[tuple[str, str, list[int]]] = []
        for row in traffic:
            if not (isinstance(row, list) and len(row) == 2 + len(_TRAFFIC)):
                raise ShareError("a traffic row is [tenant, deployment, requests, bytes_in, bytes_out]")
            rows.append((_text(row[0]), _text(row[1]), _counts(row[2:], len(_TRAFFIC))))
        for name, values in counts.items():
            c = self.table.counter(name)
            for f, v in zip(_SUMMED, values, strict=True):
                setattr(c, f, getattr(c, f) + v)
        mine = self._outstanding.setdefault(worker, {})
        for name, n in levels.items():
            c = self.table.counter(name)
            c.outstanding += n - mine.get(name, 0)
            mine[name] = n
        for tenant, deployment, values in rows:
            t: TenantTraffic = self.table.tenant_traffic(tenant, deployment)
            t.requests += values[0]
            t.bytes_in += values[1]
            t.bytes_out += values[2]
            self.served[worker] = self.served.get(worker, 0) + values[0]

    def gone(self, worker: int) -> None:
        """The worker's process is gone: its requests in flight are no longer in flight."""
        for name, n in self._outstanding.pop(worker, {}).items():
            c: DeploymentCounters = self.table.counter(name)
            c.outstanding = max(0, c.outstanding - n)


def _counts(values: Any, n: int) -> list[int]:
    if not (isinstance(values, list) and len(values) == n):
        raise ShareError(f"expected a list of {n} counts")
    return [_count(v) for v in values]


class SharedRateLimiter(RateLimiter):
    """One worker's share (1/``share``) of every tenant's token bucket: rate/share, burst ceil(burst/share)."""

    def __init__(self, clock: Clock, share: int) -> None:
        super().__init__(clock)
        if share < 1:
            raise ValueError(f"a rate-limit share is at least 1, got {share}")
        self.share = share

    def check(self, tenant: str, quota: Quota) -> int:
        if quota.requests_per_s is None:
            return 0
        rate = quota.requests_per_s / self.share
        burst = max(1, math.ceil(quota.burst / self.share))
        now = self.clock.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != rate or bucket.burst != burst:
            bucket = self._buckets[tenant] = TokenBucket(rate, burst, float(burst), now)
        wait = bucket.take(now)
        return 0 if wait == 0.0 else max(1, math.ceil(wait))


class Unlimited(RateLimiter):
    """Admits everything: the main process behind the workers, which already took the request from their shares."""

    def check(self, tenant: str, quota: Quota) -> int:
        return 0
