"""Routing policy: which replica of a deployment gets the next request.

The mechanism (retries, ejection, counting) lives in the forwarding core, ``gateway/forward.py``; this module only
chooses. The default is the power of two choices on outstanding requests (as Ray Serve's router): sample two ready
replicas, send to the one with fewer requests in flight. It balances as well as least-outstanding with O(1) work
and no herding on a replica that just became free. When both have as many in flight and both round trips from the
gateway are measured (``gateway.latency``), the nearer one goes first if it is nearer by more than
:data:`LATENCY_TIE_US` (closer than that, the measurement cannot tell them apart and the draw decides).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from octacloud.metering import Traffic


@dataclass(slots=True)
class Endpoint:
    """A ready replica as the gateway sees it."""

    replica_id: str
    host: str
    http_port: int
    grpc_port: int
    outstanding: int = 0
    failures: int = 0
    """Consecutive transport failures (refused, reset, timed out); at the limit the endpoint is ejected."""
    ejected_until: float = 0.0
    """While ``failures`` is at the limit: no request before this time (the route table's clock); after it,
    one trial request at a time until one succeeds (then ``failures`` is 0) or fails (a longer ejection)."""
    ejections: int = 0
    """Ejections in a row: each doubles the next one's length (see :class:`OutlierPolicy`)."""
    last_ejected_at: float = -math.inf


@dataclass(slots=True)
class DeploymentCounters:
    """What the gateway measured for one deployment (read by the autoscaler and the meter)."""

    requests: int = 0
    failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    latency_us_total: int = 0
    outstanding: int = 0
    shed: int = 0
    """Requests refused with 503 because the deployment had as many in flight as its bound (not billed)."""
    first_tokens: int = 0
    """Generation streams whose first token arrived (a generative deployment's autoscaler reads these two)."""
    first_token_us_total: int = 0
    """Their time to first token, summed: from the request's admission to the first event of its stream."""


@dataclass(frozen=True, slots=True)
class Owner:
    """Who owns a deployment, and whether other tenants may use it."""

    tenant: str
    published: bool = False


@dataclass(frozen=True, slots=True)
class NotAdmitted:
    """Why a request for a deployment does not go on, the same for REST and gRPC: ``unknown`` (not there, or
    not the caller's to see: one answer for both), ``no replica`` (none ready yet) or ``at capacity`` (its
    in-flight bound reached); ``message`` is what the caller is told."""

    why: str
    message: str


MAX_CONSECUTIVE_FAILURES = 3

LATENCY_TIE_US = 20
"""Round trips within this many microseconds of each other count as equal (replicas on one host, or on racks a
few switch hops apart, differ by less than a loaded machine's measurement noise)."""

GONE_MEMORY_S = 30.0
"""How long the route table remembers a replica found dead (long enough for every gateway worker to hear)."""


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """When a replica that fails is ejected, and for how long (Envoy's consecutive-failure outlier detection).

    After ``consecutive_failures`` transport failures in a row the endpoint gets no requests for
    ``base_ejection_s``; each further ejection in a row doubles that, up to ``max_ejection_s``. An ejection
    ends by itself; then one request at a time is let in as a trial. A successful readiness probe from the
    controller (:meth:`RouteTable.readmit`) ends it at once. After ``forget_after_s`` without an ejection the
    doubling starts again from the base.
    """

    consecutive_failures: int = MAX_CONSECUTIVE_FAILURES
    base_ejection_s: float = 1.0
    max_ejection_s: float = 30.0
    forget_after_s: float = 60.0

    def ejection_s(self, ejections: int) -> float:
        return float(min(self.max_ejection_s, self.base_ejection_s * 2 ** min(ejections, 30)))


@dataclass(slots=True)
class RouteTable:
    """Deployment name → its ready endpoints. Replaced wholesale by the controller; read per request."""

    routes: dict[str, list[Endpoint]] = field(default_factory=dict)
    counters: dict[str, DeploymentCounters] = field(default_factory=dict)
    owners: dict[str, Owner] = field(default_factory=dict)
    """Deployment name → owner, set by the controller; the front ends hide deployments a caller may not see."""
    traffic: dict[tuple[str, str], Traffic] = field(default_factory=dict)
    """(calling tenant, deployment) → what the gateway carried for that tenant to that deployment: usage
    attributed to whoever sent it (the meter reads copies)."""
    rng: random.Random = field(default_factory=random.Random)
    outlier: OutlierPolicy = field(default_factory=OutlierPolicy)
    now: Callable[[], float] = time.monotonic
    """The clock ejections are timed on (injected in tests)."""
    inflight_per_replica: dict[str, int] = field(default_factory=dict)
    """Deployment → its in-flight bound per ready replica, where it differs from the gateway's default
    (``GatewayLimits.max_inflight_per_replica``): e.g. twice a model's ``max_batch_size``, so that shedding
    never keeps the batcher from filling its batches."""
    on_drop: list[Callable[[Endpoint], None]] = field(default_factory=list)
    """Called with each endpoint the table stops routing to (the front ends close their connections to it)."""
    on_gone: list[Callable[[Endpoint], None]] = field(default_factory=list)
    """Called, after ``on_drop``, with each endpoint whose replica the controller found dead: nothing in flight to
    it will be answered (the REST front ends those exchanges at once, to retry them elsewhere). A replica
    stopped on purpose is dropped without this: what it has in flight drains."""
    gone: dict[str, float] = field(default_factory=dict)
    """Replica id → when it was found dead (the route table's clock), for :data:`GONE_MEMORY_S` (gateway
    workers learn of it from the route snapshots)."""
    latency_us: dict[str, int] = field(default_factory=dict)
    """Replica id → the round trip measured to it from the gateway (``gateway.latency``), microseconds: breaks
    ties between replicas with as many requests in flight. Replaced whole by each round of measurements."""
    inflight_elsewhere: dict[str, int] = field(default_factory=dict)
    """In a gateway worker: deployment → requests the other workers have in flight, as they last pushed it (every
    0.25 s; ``gateway.sharing``). They count against the deployment's in-flight bound here too."""
    on_eject: list[Callable[[Endpoint], None]] = field(default_factory=list)
    """Called with each endpoint this table ejects and, in the main process, each one a gateway worker said it
    ejected (a worker tells the main process, whose readmissions reach only the workers that ejected something;
    the controller probes an ejected replica at its next check)."""
    _by_replica: dict[str, Endpoint] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Replica id → its endpoint in ``routes`` (what :meth:`readmit` and :meth:`endpoint` look up)."""

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
        kept_ids = {id(e) for e in new}
        self.routes[deployment] = new
        self.counters.setdefault(deployment, DeploymentCounters())
        self._dropped(e for e in old.values() if id(e) not in kept_ids)
        for e in new:
            self._by_replica[e.replica_id] = e

    def remove(self, deployment: str) -> None:
        self._dropped(self.routes.pop(deployment, []))
        self.owners.pop(deployment, None)

    def drop_endpoint(self, replica_id: str, gone: bool = False) -> None:
        """Stop routing to a replica at once: it is being stopped, or (``gone``) it died."""
        now = self.now()
        if gone:
            self.gone[replica_id] = now
        for stale in [k for k, at in self.gone.items() if now - at > GONE_MEMORY_S]:
            del self.gone[stale]
        for name, endpoints in self.routes.items():
            dropped = [e for e in endpoints if e.replica_id == replica_id]
            if not dropped:
                continue
            self.routes[name] = [e for e in endpoints if e.replica_id != replica_id]
            self._dropped(dropped)
            if gone:
                for e in dropped:
                    for callback in self.on_gone:
                        callback(e)

    def _dropped(self, endpoints: Iterable[Endpoint]) -> None:
        for e in endpoints:
            if self._by_replica.get(e.replica_id) is e:
                del self._by_replica[e.replica_id]
            for callback in self.on_drop:
                callback(e)

    def admissible(self, e: Endpoint, now: float) -> bool:
        """Not ejected: below the failure limit, or its ejection is over and no trial request is in flight."""
        return e.failures < self.outlier.consecutive_failures or (now >= e.ejected_until and e.outstanding == 0)

    def healthy(self, deployment: str, exclude: Sequence[str] = ()) -> list[Endpoint]:
        """The endpoints of ``deployment`` that are not ejected, except the replicas in ``exclude``."""
        now = self.now()
        return [e for e in self.routes.get(deployment, ()) if e.replica_id not in exclude and self.admissible(e, now)]

    def failed(self, e: Endpoint) -> None:
        """A transport failure on ``e``: at the limit (or on a failed trial) it is ejected for a while."""
        e.failures += 1
        if e.failures < self.outlier.consecutive_failures:
            return
        now = self.now()
        if now - e.last_ejected_at > self.outlier.forget_after_s:
            e.ejections = 0
        e.ejected_until = now + self.outlier.ejection_s(e.ejections)
        e.ejections += 1
        e.last_ejected_at = now
        for callback in self.on_eject:
            callback(e)

    def succeeded(self, e: Endpoint) -> None:
        """``e`` answered: its failures (and any ejection) are over."""
        e.failures = 0

    def endpoint(self, replica_id: str) -> Endpoint | None:
        """The endpoint routed to replica ``replica_id`` (None: not routed)."""
        return self._by_replica.get(replica_id)

    def readmit(self, replica_id: str) -> bool:
        """The controller found the replica ready: end its ejection now (its ejection count is kept). Whether it
        was ejected; one that is not keeps its failures (a success resets them)."""
        e = self._by_replica.get(replica_id)
        if e is None or e.failures < self.outlier.consecutive_failures:
            return False
        e.failures = 0
        e.ejected_until = 0.0
        return True

    def inflight_bound(self, deployment: str, default_per_replica: int) -> int:
        """How many requests ``deployment`` may have in flight now (0: no bound)."""
        per_replica = self.inflight_per_replica.get(deployment, default_per_replica)
        return per_replica * len(self.routes.get(deployment, ()))

    def admit(
        self, deployment: str, may_see: Callable[[str, bool], bool] | None, default_per_replica: int
    ) -> DeploymentCounters | NotAdmitted:
        """Whether a request for ``deployment`` goes on: its counters, or why not. ``may_see(tenant, published)``
        is the caller's visibility (None: no keys, every deployment is visible). A refusal at the in-flight
        bound is counted in ``shed``; the caller takes the slot (``outstanding``) once the request goes on."""
        owner = self.owners.get(deployment)
        if may_see is None:
            visible = owner is not None or deployment in self.routes
        else:
            visible = owner is not None and may_see(owner.tenant, owner.published)
        if not visible:
            return NotAdmitted("unknown", f"unknown model or deployment '{deployment}'")
        if not self.routes.get(deployment):
            return NotAdmitted("no replica", f"deployment '{deployment}' has no ready replica yet")
        counters = self.counter(deployment)
        bound = self.inflight_bound(deployment, default_per_replica)
        if bound and counters.outstanding + self.inflight_elsewhere.get(deployment, 0) >= bound:
            counters.shed += 1
            return NotAdmitted("at capacity", f"deployment '{deployment}' is at capacity ({bound} requests in flight)")
        return counters

    def retry_after(self, deployment: str) -> int:
        """Whole seconds until the first ejected endpoint of ``deployment`` may be tried again (at least 1)."""
        now = self.now()
        waits = [e.ejected_until - now for e in self.routes.get(deployment, ()) if e.ejected_until > now]
        return max(1, math.ceil(min(waits))) if waits else 1

    def choose(self, deployment: str, exclude: Sequence[str] = ()) -> Endpoint | None:
        """Power of two choices among healthy endpoints not in ``exclude`` (fewer in flight, then the lower
        measured latency); None when there is none."""
        healthy = self.healthy(deployment, exclude)
        if not healthy:
            return None
        if len(healthy) == 1:
            return healthy[0]
        a, b = self.rng.sample(healthy, 2)
        if a.outstanding != b.outstanding:
            return a if a.outstanding < b.outstanding else b
        la, lb = self.latency_us.get(a.replica_id), self.latency_us.get(b.replica_id)
        if la is not None and lb is not None and abs(la - lb) > LATENCY_TIE_US:
            return a if la < lb else b
        return a

    def tenant_traffic(self, tenant: str, deployment: str) -> Traffic:
        t = self.traffic.get((tenant, deployment))
        if t is None:
            t = self.traffic[(tenant, deployment)] = Traffic()
        return t

    def counter(self, deployment: str) -> DeploymentCounters:
        c = self.counters.get(deployment)
        if c is None:
            c = self.counters[deployment] = DeploymentCounters()
        return c
