"""The cloud's ``/metrics``: GPU telemetry, the scheduler, the gateway, the replicas and their Triton metrics.

:class:`CloudCollector` reads the monitor's latest sample and the live scheduler state at scrape time; it does
no I/O (replicas were scraped by the monitor's last tick), so a Prometheus scrape costs microseconds and never
fans out to replicas. Every name and label is listed in ``docs/monitoring.md``; a test keeps the two in step.

Counters keep the names their origin gives them: dcgm-exporter's and Triton's names carry no ``_total`` (they are
written as their exporters write them), octacloud's own counters end in ``_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from octacloud.observability import dcgm
from octacloud.observability.monitor import CloudMonitor
from octacloud.observability.scheduling import SchedulingStats
from octacloud.observability.telemetry import CPU_FIELDS, FleetSample

CARD_LABELS = ("node", "gpu", "modelName", "replicas", "deployments")
DCGM_LABELS = (*dcgm.LABELS, "node", "replicas", "deployments")
REPLICA_LABELS = ("deployment", "replica", "node")
SERVING_EXTRA_LABELS = ("replica", "node")
"""Added to each replica's Triton samples re-exported by the cloud (``model`` is already the deployment)."""

MeteringSource = Callable[[], Iterator[Metric]]
"""Yields the metering ledger's metric families (supplied by the cloud once a ledger exists)."""


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


class CloudCollector(Collector):  # type: ignore[misc]
    """Yields every cloud-level metric family; see the module docstring."""

    def __init__(
        self, monitor: CloudMonitor, scheduling: SchedulingStats, metering: MeteringSource | None = None
    ) -> None:
        self.monitor = monitor
        self.scheduling = scheduling
        self.metering = metering

    def collect(self) -> Iterator[Metric]:
        sample = self.monitor.latest
        yield from self._telemetry(sample)
        yield from self._allocation(sample)
        yield from self._scheduler(sample)
        yield from self._gateway()
        if sample is not None:
            yield from self._replicas(sample)
            yield from self._serving(sample)
        if self.metering is not None:
            yield from self.metering()

    # ---- GPU telemetry (DCGM names) and the CPU machine's equivalents ------------------------------------

    def _telemetry(self, sample: FleetSample | None) -> Iterator[Metric]:
        cards = list(sample.cards.values()) if sample is not None else []
        for name, (kind, doc) in dcgm.FIELDS.items():
            metric = Metric(name, doc, kind if kind == "gauge" else "unknown")
            for c in cards:
                if c.source != "nvml" or name not in c.values or c.identity is None:
                    continue
                labels = {
                    "gpu": str(c.gpu),
                    "UUID": c.identity.uuid,
                    "device": f"nvidia{c.identity.index}",
                    "modelName": c.identity.model,
                    "pci_bus_id": c.identity.pci_bus_id,
                    "Hostname": c.node,
                    "node": c.node,
                    "replicas": ",".join(c.replicas),
                    "deployments": ",".join(c.deployments),
                }
                metric.add_sample(name, labels, c.values[name])
            yield metric
        for name, doc in CPU_FIELDS.items():
            gauge = _gauge(name, doc, CARD_LABELS)
            for c in cards:
                if c.source == "replicas" and name in c.values:
                    gauge.add_metric(
                        [c.node, str(c.gpu), c.model, ",".join(c.replicas), ",".join(c.deployments)], c.values[name]
                    )
            yield gauge
        age = _gauge("octacloud_telemetry_sample_age_seconds", "Seconds since the last telemetry sample.")
        if sample is not None:
            age.add_metric([], max(0.0, self.monitor.clock.monotonic() - sample.monotonic))
        yield age
        ticks = _counter("octacloud_telemetry_samples", "Telemetry samples taken since the cloud started.")
        ticks.add_metric([], float(self.monitor.ticks))
        yield ticks

    # ---- what the scheduler allocated, card by card --------------------------------------------------------

    def _allocation(self, sample: FleetSample | None) -> Iterator[Metric]:
        state = self.monitor.state
        infos = {r.info.id: r.info for r in sample.replicas.values()} if sample is not None else {}
        capacity = _gauge(
            "octacloud_card_capacity_milli", "Milli-GPU a card offers (1000).", ("node", "gpu", "modelName")
        )
        allocated = _gauge(
            "octacloud_card_allocated_milli",
            "Milli-GPU of a card the scheduler allocated.",
            ("node", "gpu", "modelName"),
        )
        usable = _gauge(
            "octacloud_card_usable", "1 when the card takes new work (node and card healthy).", ("node", "gpu")
        )
        holders = _gauge(
            "octacloud_card_replica_milli",
            "Milli-GPU of a card held by one replica (125 per octant).",
            ("node", "gpu", "replica", "deployment", "tenant"),
        )
        node_frag = _gauge(
            "octacloud_node_fragmentation_milli", "Fragmented milli-GPU of a node (FGD's measure).", ("node",)
        )
        self.monitor.fragmentation_milli()
        for i, node in enumerate(state.nodes):
            node_frag.add_metric([node.name], self.monitor.tracker.per_node[i])
            for g in node.gpus:
                labels = [node.name, str(g.index), g.model]
                capacity.add_metric(labels, 1000.0)
                allocated.add_metric(labels, float(1000 - state.free_gpu[i][g.index]))
                usable.add_metric([node.name, str(g.index)], 1.0 if state.card_usable(i, g.index) else 0.0)
            for a in state.on_node[i].values():
                info = infos.get(a.request.name)
                deployment = info.deployment if info is not None else ""
                for g_index in a.placement.gpus:
                    labels = [node.name, str(g_index), a.request.name, deployment, a.request.owner]
                    holders.add_metric(labels, float(a.placement.milli_per_gpu))
        yield from (capacity, allocated, usable, holders, node_frag)

    def _scheduler(self, sample: FleetSample | None) -> Iterator[Metric]:
        state, stats = self.monitor.state, self.scheduling
        total = state.total_gpu_milli
        frag = self.monitor.tracker.total
        idle = self.monitor.tracker.idle_gpu_milli()
        for name, doc, value in (
            ("octacloud_scheduler_capacity_milli", "Milli-GPU of the whole fleet.", float(total)),
            (
                "octacloud_scheduler_allocated_milli",
                "Milli-GPU allocated to replicas.",
                float(state.allocated_gpu_milli),
            ),
            (
                "octacloud_scheduler_allocation_ratio",
                "Allocated share of the fleet's milli-GPU, 0..1.",
                state.allocated_gpu_milli / total if total else 0.0,
            ),
            ("octacloud_scheduler_fragmentation_milli", "Fragmented milli-GPU of the fleet (FGD's measure).", frag),
            (
                "octacloud_scheduler_fragmentation_ratio",
                "Fragmented share of the idle milli-GPU, 0..1 (FGD's fragmentation rate).",
                frag / idle if idle else 0.0,
            ),
        ):
            g = _gauge(name, doc)
            g.add_metric([], value)
            yield g
        pending = _gauge(
            "octacloud_scheduler_pending_replicas", "Replicas waiting for a slice, by shape.", ("octants", "gpus")
        )
        shapes: dict[tuple[str, str], int] = {}
        for r in sample.replicas.values() if sample is not None else ():
            if r.info.state == "pending":
                octants = r.info.octants
                key = (str(octants), str(max(1, octants // 8)) if octants >= 8 else "1")
                shapes[key] = shapes.get(key, 0) + 1
        for key, n in sorted(shapes.items()):
            pending.add_metric(list(key), float(n))
        yield pending
        decisions = _counter("octacloud_scheduler_decisions", "Placement attempts by outcome.", ("outcome",))
        for outcome, n in stats.decisions.items():
            decisions.add_metric([outcome.value], float(n))
        yield decisions
        latency = HistogramMetricFamily(
            "octacloud_scheduler_decision_duration_seconds",
            "Time one placement attempt took (scheduler cycle plus any preemption search).",
        )
        latency.add_metric([], [(le, float(n)) for le, n in stats.cumulative_buckets()], stats.latency_sum_s)
        yield latency
        for name, doc, count in (
            ("octacloud_scheduler_preemptions", "Replicas evicted for higher-priority ones.", stats.preemptions),
            (
                "octacloud_scheduler_defragmentation_moves",
                "Replicas moved to consolidate free octants.",
                stats.defragmentation_moves,
            ),
        ):
            c = _counter(name, doc)
            c.add_metric([], float(count))
            yield c

    # ---- the gateway, the replicas, and their Triton metrics -----------------------------------------------

    def _gateway(self) -> Iterator[Metric]:
        counters = self.monitor.gateway()
        families: list[tuple[CounterMetricFamily | GaugeMetricFamily, Callable[[Any], float]]] = [
            (
                _counter("octacloud_gateway_requests", "Requests the gateway received.", ("deployment",)),
                lambda c: c.requests,
            ),
            (
                _counter("octacloud_gateway_request_failures", "Requests answered with an error.", ("deployment",)),
                lambda c: c.failures,
            ),
            (
                _counter("octacloud_gateway_received_bytes", "Request body bytes.", ("deployment",)),
                lambda c: c.bytes_in,
            ),
            (_counter("octacloud_gateway_sent_bytes", "Response body bytes.", ("deployment",)), lambda c: c.bytes_out),
            (
                _counter("octacloud_gateway_request_duration_seconds", "Cumulative request time.", ("deployment",)),
                lambda c: c.latency_us_total / 1e6,
            ),
            (
                _gauge("octacloud_gateway_outstanding_requests", "Requests in flight now.", ("deployment",)),
                lambda c: c.outstanding,
            ),
        ]
        for family, read in families:
            for name, c in sorted(counters.items()):
                family.add_metric([name], float(read(c)))
            yield family

    def _replicas(self, sample: FleetSample) -> Iterator[Metric]:
        states = _gauge("octacloud_replicas", "Replicas by deployment and state.", ("deployment", "state"))
        counted: dict[tuple[str, str], int] = {}
        restarts = _counter("octacloud_replica_restarts", "Restarts of a replica on its slice.", REPLICA_LABELS)
        busy = _gauge(
            "octacloud_replica_busy_ratio", "Share of the last interval spent executing batches.", REPLICA_LABELS
        )
        cpu = _counter("octacloud_replica_cpu_seconds", "CPU time of the replica's process.", REPLICA_LABELS)
        rss = _gauge(
            "octacloud_replica_resident_memory_bytes", "Resident memory of the replica's process.", REPLICA_LABELS
        )
        for r in sample.replicas.values():
            info = r.info
            counted[(info.deployment, info.state)] = counted.get((info.deployment, info.state), 0) + 1
            labels = [info.deployment, info.id, info.node]
            restarts.add_metric(labels, float(info.restarts))
            if r.busy_ratio is not None:
                busy.add_metric(labels, r.busy_ratio)
            if r.cpu_seconds is not None:
                cpu.add_metric(labels, r.cpu_seconds)
            if r.rss_bytes is not None:
                rss.add_metric(labels, float(r.rss_bytes))
        for (deployment, state), n in sorted(counted.items()):
            states.add_metric([deployment, state], float(n))
        yield from (states, restarts, busy, cpu, rss)

    @staticmethod
    def _serving(sample: FleetSample) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for r in sample.replicas.values():
            if r.serving is None:
                continue
            for family in r.serving.families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    labels = {**s.labels, "replica": r.info.id, "node": r.info.node}
                    out.add_sample(s.name, labels, s.value)
        yield from merged.values()


def cloud_registry(collector: CloudCollector, *extra: Collector) -> CollectorRegistry:
    """A fresh registry (not the global one) holding the cloud's collector and any ``extra`` ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    for c in extra:
        registry.register(c)
    return registry


__all__ = ["CARD_LABELS", "DCGM_LABELS", "CloudCollector", "Collector", "cloud_registry"]
