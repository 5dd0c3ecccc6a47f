"""Node telemetry as the scheduler sees it: an interface, no I/O.

The fleet's monitoring (NVML, DCGM, a metrics store, a fleet file) lives outside the scheduler and supplies a
:class:`TelemetrySource`; telemetry-fed scoring terms read one snapshot per scheduling cycle. Metric names are
free-form; the ones octacloud's monitoring exports are listed in :data:`KNOWN_METRICS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

NodeTelemetry = Mapping[str, Mapping[str, float]]
"""Node name → metric name → value."""

KNOWN_METRICS: Mapping[str, str] = MappingProxyType(
    {
        "gpu_utilisation": "mean SM utilisation of the node's cards, 0..1",
        "gpu_memory_bandwidth": "mean memory-bandwidth utilisation of the node's cards, 0..1",
        "pcie_throughput": "PCIe throughput utilisation, 0..1",
        "network_latency_us": "p50 round-trip to the gateway, microseconds",
        "network_load": "NIC utilisation, 0..1",
        "power_price": "electricity price at the node's site, per kWh",
        "power_draw_w": "current power draw of the node, watts",
        "temperature_c": "hottest card temperature, degrees Celsius",
        "ecc_errors": "correctable ECC errors in the last hour",
        "cpu_utilisation": "CPU utilisation, 0..1",
        "disk_cache_hit": "local SSD model-cache hit ratio, 0..1",
        "carbon_intensity": "grid carbon intensity at the node's site, gCO2/kWh",
    }
)


@runtime_checkable
class TelemetrySource(Protocol):
    """Supplies node metrics.

    :meth:`snapshot` must be cheap (it is called once per scheduling cycle), must not block on I/O, and returns
    values that stay unchanged while the cycle runs. Nodes or metrics may be missing; consumers decide what a
    missing value means.
    """

    def snapshot(self) -> NodeTelemetry: ...


class StaticTelemetry:
    """A fixed snapshot (tests, simulations, a fleet file); :meth:`update` replaces values between cycles."""

    def __init__(self, values: NodeTelemetry | None = None) -> None:
        self._values: dict[str, dict[str, float]] = {n: dict(m) for n, m in (values or {}).items()}

    def snapshot(self) -> NodeTelemetry:
        return self._values

    def update(self, node: str, **metrics: float) -> None:
        self._values.setdefault(node, {}).update(metrics)
