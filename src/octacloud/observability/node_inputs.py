"""``/metrics``: what the scheduler reads of each node, as it reads it.

The multi-objective profile's telemetry terms read one snapshot of a :class:`TelemetrySource` per cycle: the
sampler's measurements (the NIC load, the power draw, CPU use), the gateway's measured round trip to the node and
its tariff's power price and cost now. :class:`NodeInputsCollector` exports that same snapshot at scrape time,
one gauge family per metric of :data:`~octacloud.scheduler.telemetry.KNOWN_METRICS` (``octacloud_node_<metric>``,
labelled by node), so an operator sees the inputs a placement was scored on. Metrics a source names outside that
list are not exported (their names are not a stable interface); a node without a value is left out of the family.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octacloud.scheduler.telemetry import KNOWN_METRICS, TelemetrySource

PREFIX = "octacloud_node_"


class NodeInputsCollector(Collector):  # type: ignore[misc]
    """One gauge family per known node metric, from ``source``'s snapshot now (no I/O: snapshots are cheap)."""

    def __init__(self, source: TelemetrySource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source.snapshot()
        for metric, doc in KNOWN_METRICS.items():
            family = GaugeMetricFamily(PREFIX + metric, f"What the scheduler reads of a node: {doc}.", labels=["node"])
            for node in sorted(snapshot):
                value = snapshot[node].get(metric)
                if value is not None:
                    family.add_metric([node], float(value))
            yield family


__all__ = ["PREFIX", "NodeInputsCollector"]
