"""Measured network inputs: each route's round trip from the gateway to its replica, over the real transport.

Every round (:data:`PROBE_INTERVAL_S`) the gateway opens a TCP connection to a ready replica's HTTP port on each
host a few times and reads the kernel's own measure of the handshake's round trip (``TCP_INFO``'s ``tcpi_rtt``, in
microseconds: SYN to SYN-ACK, with no server code and no Python scheduling in it); the least of the tries is the
latency of every route to that host (replicas on one host share its path; when a replica does not answer, the
host's next one is tried). On Ray the replicas' hosts are the Ray nodes, so this is the path between nodes; on
one machine it is loopback, one measurement for every replica.

What it feeds:

- the route table (:attr:`RouteTable.latency_us`): when two replicas have as many requests in flight, the
  gateway sends to the one with the lower measured latency;
- the scheduler's ``network_latency_us`` per node (:meth:`RouteLatency.node_latency_us`: the least over the
  node's routes);
- reports: a route measured over the budget (:data:`LATENCY_BUDGET_US`, the design's 50 µs for a path between
  nodes) is reported once when it goes over and once when it comes back (``on_report``: the cloud's events),
  and exported at every scrape (:class:`RouteLatencyCollector`).

A route that cannot be measured this round (refused, timed out) keeps no latency: it is neither preferred nor
reported until a handshake succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octacloud.gateway.routing import Endpoint, RouteTable

log = logging.getLogger("octacloud.gateway.latency")

LATENCY_BUDGET_US = 50
"""A route between nodes slower than this is reported (the design's budget for cross-node paths)."""
PROBE_INTERVAL_S = 5.0
TCPI_RTT_OFFSET = 68
"""Where ``struct tcp_info`` holds ``tcpi_rtt`` (u32, µs) on Linux."""
MAX_CONCURRENT = 16


class RoundTrip(Protocol):
    """Measures one route: the round trip to ``host:port`` in microseconds, or None when it cannot. Blocking (the
    prober runs it in a worker thread)."""

    def rtt_us(self, host: str, port: int) -> int | None: ...


class TcpHandshake:
    """The least ``tcpi_rtt`` of ``tries`` TCP handshakes with ``host:port`` (each connection closed at once)."""

    def __init__(self, tries: int = 3, timeout_s: float = 1.0) -> None:
        if tries < 1:
            raise ValueError(f"tries must be at least 1, got {tries}")
        self.tries, self.timeout_s = tries, timeout_s

    def rtt_us(self, host: str, port: int) -> int | None:
        tcp_info = getattr(socket, "TCP_INFO", None)
        if tcp_info is None or port <= 0:
            return None
        best: int | None = None
        for _ in range(self.tries):
            try:
                with socket.create_connection((host, port), timeout=self.timeout_s) as s:
                    info = s.getsockopt(socket.IPPROTO_TCP, tcp_info, 104)
            except OSError:
                continue
            if len(info) < TCPI_RTT_OFFSET + 4:
                return None
            rtt = int(struct.unpack_from("I", info, TCPI_RTT_OFFSET)[0])
            best = rtt if best is None else min(best, rtt)
        return best


@dataclass(frozen=True, slots=True)
class Route:
    """One measured route: a replica of a deployment, on a node, ``latency_us`` from the gateway."""

    deployment: str
    replica: str
    node: str
    latency_us: int


class RouteLatency:
    """Measures every route of ``routes`` each round; see the module docstring. ``nodes()`` maps replicas to their
    nodes, read once a round (a replica it does not name still counts for routing, not for a node's telemetry);
    ``on_report(deployment, replica, message)`` is told of a route going over the budget and coming back."""

    def __init__(
        self,
        routes: RouteTable,
        meter: RoundTrip | None = None,
        nodes: Callable[[], Mapping[str, str]] = dict,
        budget_us: int = LATENCY_BUDGET_US,
        on_report: Callable[[str, str, str], None] | None = None,
    ) -> None:
        if budget_us <= 0:
            raise ValueError(f"latency budget must be > 0 µs, got {budget_us}")
        self.routes, self.meter, self.nodes = routes, meter or TcpHandshake(), nodes
        self.budget_us, self.on_report = budget_us, on_report
        self.measured: dict[str, Route] = {}
        """Replica → its route as last measured (replaced whole each round)."""
        self.over: set[str] = set()
        """Replicas whose route is over the budget now."""
        self.reports = 0
        """Routes reported over the budget so far."""
        self._nodes: dict[str, float] = {}

    def node_latency_us(self) -> Mapping[str, float]:
        """Node → the least latency measured to any of its replicas in the last round (``network_latency_us``)."""
        return self._nodes

    async def measure(self) -> dict[str, Route]:
        """One round: every host of a ready route measured (at most :data:`MAX_CONCURRENT` at once, off the event
        loop), its latency given to each of its routes."""
        hosts: dict[str, list[tuple[str, Endpoint]]] = {}
        for name, endpoints in self.routes.routes.items():
            for e in endpoints:
                hosts.setdefault(e.host, []).append((name, e))
        gate = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(host: str, ports: list[int]) -> int | None:
            async with gate:
                for port in ports:  # the first replica that completes a handshake measures the host
                    rtt = await asyncio.to_thread(self.meter.rtt_us, host, port)
                    if rtt is not None:
                        return rtt
                return None

        results = await asyncio.gather(
            *(one(host, list(dict.fromkeys(e.http_port for _, e in group))) for host, group in hosts.items()),
            return_exceptions=True,
        )
        measured: dict[str, Route] = {}
        node_of = self.nodes()
        for (host, group), rtt in zip(hosts.items(), results, strict=True):
            if isinstance(rtt, BaseException):
                log.warning("routes to %s: not measured: %s", host, rtt)
                continue
            if rtt is not None:
                for name, e in group:
                    measured[e.replica_id] = Route(name, e.replica_id, node_of.get(e.replica_id, ""), rtt)
        self._apply(measured)
        return measured

    def _apply(self, measured: dict[str, Route]) -> None:
        self.measured = measured
        self.routes.latency_us = {r.replica: r.latency_us for r in measured.values()}
        nodes: dict[str, float] = {}
        for r in measured.values():
            if r.node:
                nodes[r.node] = min(nodes.get(r.node, float("inf")), r.latency_us)
        self._nodes = nodes
        for r in measured.values():
            if r.latency_us > self.budget_us and r.replica not in self.over:
                self.over.add(r.replica)
                self.reports += 1
                where = f" on node {r.node}" if r.node else ""
                self._report(r, f"route to {r.replica}{where}: {r.latency_us} µs round trip, over the "
                                f"{self.budget_us} µs budget; the gateway prefers nearer replicas")  # fmt: skip
            elif r.latency_us <= self.budget_us and r.replica in self.over:
                self.over.discard(r.replica)
                self._report(r, f"route to {r.replica}: {r.latency_us} µs round trip, within the budget again")
        routed = {e.replica_id for endpoints in self.routes.routes.values() for e in endpoints}
        self.over = {rid for rid in self.over if rid in measured or rid in routed}  # a replica gone: forgotten

    def _report(self, route: Route, message: str) -> None:
        log.warning("%s", message)
        if self.on_report is not None:
            try:
                self.on_report(route.deployment, route.replica, message)
            except Exception:  # a report must never stop the measuring
                log.exception("latency report failed")

    async def run(self, stop: asyncio.Event, interval_s: float = PROBE_INTERVAL_S) -> None:
        while not stop.is_set():
            try:
                await self.measure()
            except Exception:  # the prober must not take the cloud down; it is logged and tried next round
                log.exception("route latency round failed")
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass


class RouteLatencyCollector(Collector):  # type: ignore[misc]
    """``/metrics``: each route's measured latency and how many routes are over the budget now."""

    def __init__(self, latency: RouteLatency) -> None:
        self.latency = latency

    def collect(self) -> Iterator[Metric]:
        routes = GaugeMetricFamily(
            "octacloud_route_latency_us",
            "Round trip from the gateway to the replica (TCP handshake, kernel-measured), microseconds.",
            labels=["deployment", "replica", "node"],
        )
        for r in sorted(self.latency.measured.values(), key=lambda r: r.replica):
            routes.add_metric([r.deployment, r.replica, r.node], r.latency_us)
        yield routes
        yield GaugeMetricFamily(
            "octacloud_routes_over_latency_budget",
            f"Routes whose measured round trip is over the {self.latency.budget_us} µs budget now.",
            value=len(self.latency.over),
        )
