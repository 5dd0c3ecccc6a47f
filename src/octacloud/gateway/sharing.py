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
- **Rate limits.** Each worker enforces a fraction of every tenant's rate and burst (:class:`SharedRateLimiter`),
  1/N until the main process says otherwise. Workers report how many requests each rate-limited tenant sent
  them; every rebalance the main process (:class:`DemandShares`) splits each busy tenant's rate by that demand,
  so that a client whose connections all land on one worker (a gRPC client has one connection) gets most of it
  there. Together the workers never admit more than the tenant's rate, plus at most N-1 requests of rounding
  in the burst.
- **In-flight bounds.** A worker counts what the others have in flight at a deployment, as they last pushed it
  (:meth:`CounterMerger.elsewhere`), against the deployment's bound: no worker's share is fixed, so none sheds
  while the others leave the bound unused; workers that take requests in the same push interval may together
  pass the bound by what they took in it.
- **Generation limits.** Not shared out but held by the main process alone (``gateway.generations``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from octacloud.core.clock import Clock
from octacloud.gateway.routing import (
    GONE_MEMORY_S,
    DeploymentCounters,
    Endpoint,
    Owner,
    RouteTable,
)
from octacloud.metering import Traffic
from octacloud.tenancy.keys import Quota
from octacloud.tenancy.limits import RateLimiter, TokenBucket

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
        "latency": dict(table.latency_us),
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
    new_inflight = {_text(name): count(n) for name, n in inflight.items()}
    gone = snapshot.get("gone", [])  # absent in a snapshot of an older main process
    if not (isinstance(gone, list) and all(isinstance(g, str) for g in gone)):
        raise ShareError("gone is not a list of replica ids")
    latency = snapshot.get("latency", {})  # absent in a snapshot of an older main process
    if not (isinstance(latency, dict) and all(isinstance(k, str) for k in latency)):
        raise ShareError("latency is not a mapping of replica id to microseconds")
    new_latency = {k: count(v) for k, v in latency.items()}
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
    table.latency_us = new_latency


def _endpoint(item: Any) -> Endpoint:
    if not (isinstance(item, list) and len(item) == 4):
        raise ShareError("an endpoint is [replica_id, host, http_port, grpc_port]")
    return Endpoint(_text(item[0]), _text(item[1]), count(item[2]), count(item[3]))


def _mapping(data: Any, key: str) -> Mapping[str, Any]:
    value = data.get(key) if isinstance(data, Mapping) else None
    if not isinstance(value, Mapping):
        raise ShareError(f"{key!r} is missing or not an object")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ShareError(f"expected a string, got {type(value).__name__}")
    return value


def count(value: Any, name: str = "") -> int:
    """A non-negative integer of a feed message (``name``: the field, for the error); every feed message's counts,
    the generation owner's included, are checked with it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShareError(f"{name} is a non-negative integer, got {value!r}" if name else
                         f"expected a non-negative integer, got {value!r}")  # fmt: skip
    return value


_SUMMED = ("requests", "failures", "bytes_in", "bytes_out", "latency_us_total", "shed", "first_tokens",
           "first_token_us_total")  # fmt: skip
"""DeploymentCounters fields that only grow (pushed as deltas); ``outstanding`` is a level."""
_TRAFFIC = ("requests", "bytes_in", "bytes_out", "prompt_tokens", "completion_tokens")


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
        levels = {_text(name): count(n) for name, n in outstanding.items()}
        rows: list[tuple[str, str, list[int]]] = []
        for row in traffic:
            if not (isinstance(row, list) and len(row) == 2 + len(_TRAFFIC)):
                raise ShareError(f"a traffic row is [tenant, deployment, {', '.join(_TRAFFIC)}]")
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
            t: Traffic = self.table.tenant_traffic(tenant, deployment)
            for f, v in zip(_TRAFFIC, values, strict=True):
                setattr(t, f, getattr(t, f) + v)
            self.served[worker] = self.served.get(worker, 0) + values[0]

    def elsewhere(self, worker: int) -> dict[str, int]:
        """Deployment → requests the workers other than ``worker`` have in flight (as they last pushed)."""
        out: dict[str, int] = {}
        for w, levels in self._outstanding.items():
            if w != worker:
                for name, n in levels.items():
                    if n:
                        out[name] = out.get(name, 0) + n
        return out

    def gone(self, worker: int) -> None:
        """The worker's process is gone: its requests in flight are no longer in flight."""
        for name, n in self._outstanding.pop(worker, {}).items():
            c: DeploymentCounters = self.table.counter(name)
            c.outstanding = max(0, c.outstanding - n)


def _counts(values: Any, n: int) -> list[int]:
    if not (isinstance(values, list) and len(values) == n):
        raise ShareError(f"expected a list of {n} counts")
    return [count(v) for v in values]


RESERVE = 0.1
"""Of a busy tenant's rate, the part split evenly over the workers whatever their demand: a worker the tenant sent
nothing lately still admits a first request at once, and gets more at the next rebalance."""
DECAY = 0.5
"""A worker's demand for a tenant is halved every rebalance, then what it reported since is added."""
IDLE_DEMAND = 0.5
"""A tenant whose demand over all workers decays below this goes back to the even split."""


class SharedRateLimiter(RateLimiter):
    """One worker's part of every tenant's token bucket: ``fraction`` of the rate and ceil(fraction × burst) tokens,
    the fraction being 1/``share`` unless the main process set another (:meth:`set_fractions`). It counts what
    each rate-limited tenant asked (:meth:`take_demand`), for the main process to rebalance by."""

    def __init__(self, clock: Clock, share: int) -> None:
        super().__init__(clock)
        if share < 1:
            raise ValueError(f"a rate-limit share is at least 1, got {share}")
        self.share = share
        self.fractions: dict[str, float] = {}
        self.demand: dict[str, int] = {}

    def set_fractions(self, fractions: Any) -> None:
        """Hold these fractions (tenant → 0 < f ≤ 1; a tenant not named: 1/share); raises ShareError when
        malformed (then nothing changes). A bucket keeps its tokens, up to its new burst."""
        self.fractions = parse_fractions(fractions)

    def take_demand(self) -> dict[str, int]:
        """Requests each rate-limited tenant made since the last call (admitted or not)."""
        demand, self.demand = self.demand, {}
        return demand

    def check(self, tenant: str, quota: Quota) -> int:
        if quota.requests_per_s is None:
            return 0
        self.demand[tenant] = self.demand.get(tenant, 0) + 1
        fraction = self.fractions.get(tenant, 1 / self.share)
        rate = quota.requests_per_s * fraction
        burst = max(1, math.ceil(quota.burst * fraction))
        now = self.clock.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(rate, burst, float(burst), now)
        elif bucket.rate != rate or bucket.burst != burst:  # refilled at the old rate until now, then resized
            bucket.refill(now)
            bucket.rate, bucket.burst, bucket.tokens = rate, burst, min(bucket.tokens, float(burst))
        wait = bucket.take(now)
        if wait == 0.0:
            return 0
        # Retry-After by the tenant's whole rate: by then the rebalance has moved its rate to where it asks
        return max(1, math.ceil(min(wait, 1 / quota.requests_per_s)))


class DemandShares:
    """The main process's side of a budget the workers share (a tenant's rate): each worker's fraction of every busy
    key's budget, by demand.

    Each worker reports (:meth:`add`) how many requests each key got from it. Every :meth:`rebalance` a key's
    budget is split ``RESERVE`` evenly and the rest in proportion to each worker's recent demand (halved each
    rebalance); a key that went quiet goes back to the even split. What a worker is told to hold is the lower of
    this rebalance's plan and the previous one's: a fraction grows one rebalance after it was planned, so
    workers that applied consecutive rebalances never hold more than the whole budget between them.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"gateway workers: at least 1, got {workers}")
        self.workers = workers
        self._pending: dict[int, dict[str, int]] = {}
        self._demand: dict[str, list[float]] = {}
        self._plan: dict[str, list[float]] = {}
        self.held: list[dict[str, float]] = [{} for _ in range(workers)]
        """Worker index → what the last rebalance told it to hold (tenants at the even split left out)."""

    def add(self, worker: int, demand: Any) -> None:
        """Add what ``worker`` reported (key → requests); raises ShareError (adding nothing) when malformed."""
        if not (isinstance(worker, int) and 0 <= worker < self.workers):
            raise ShareError(f"worker index {worker!r} is not one of 0..{self.workers - 1}")
        if not isinstance(demand, Mapping):
            raise ShareError("demand is not an object")
        counts = {_text(tenant): count(n) for tenant, n in demand.items()}
        mine = self._pending.setdefault(worker, {})
        for tenant, n in counts.items():
            mine[tenant] = mine.get(tenant, 0) + n

    def gone(self, worker: int) -> None:
        """The worker's process is gone: its demand is forgotten (its fractions pass to the others over the next
        rebalances; a worker started in its place holds them meanwhile)."""
        self._pending.pop(worker, None)
        if 0 <= worker < self.workers:
            for demand in self._demand.values():
                demand[worker] = 0.0

    def rebalance(self) -> list[dict[str, float]]:
        """Plan the next fractions; returns (and keeps in ``held``) each worker's fractions to hold now."""
        n = self.workers
        for demand in self._demand.values():
            for w in range(n):
                demand[w] *= DECAY
        for w, counts in self._pending.items():
            for tenant, count in counts.items():
                self._demand.setdefault(tenant, [0.0] * n)[w] += count
        self._pending = {}
        for tenant in [t for t, d in self._demand.items() if sum(d) < IDLE_DEMAND]:
            del self._demand[tenant]
        even = 1 / n
        plan: dict[str, list[float]] = {}
        for tenant, demand in self._demand.items():
            total = sum(demand)
            plan[tenant] = [RESERVE * even + (1 - RESERVE) * d / total for d in demand]
        held: list[dict[str, float]] = [{} for _ in range(n)]
        for tenant in plan.keys() | self._plan.keys():
            now, before = plan.get(tenant), self._plan.get(tenant)
            for w in range(n):
                f = min(now[w] if now else even, before[w] if before else even)
                if f != even:
                    held[w][tenant] = f
        self._plan = plan
        self.held = held
        return held


def parse_fractions(fractions: Any) -> dict[str, float]:
    """Key → fraction in (0, 1], as a ``shares`` message carries them; raises ShareError when malformed."""
    if not isinstance(fractions, Mapping):
        raise ShareError("fractions is not an object")
    return {_text(key): _fraction(f) for key, f in fractions.items()}


def parse_levels(levels: Any) -> dict[str, int]:
    """Key → non-negative count, as a ``shares`` message carries them; raises ShareError when malformed."""
    if not isinstance(levels, Mapping):
        raise ShareError("levels is not an object")
    return {_text(key): count(n) for key, n in levels.items()}


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ShareError(f"a rate fraction is a number in (0, 1], got {value!r}")
    return float(value)


class Unlimited(RateLimiter):
    """Admits everything: the main process behind the workers, which already took the request from their shares."""

    def check(self, tenant: str, quota: Quota) -> int:
        return 0
