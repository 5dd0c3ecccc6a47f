"""Node telemetry as the scheduler sees it: an interface, no I/O.

The fleet's monitoring (NVML, DCGM, a metrics store, a fleet file) lives outside the scheduler and supplies a
:class:`TelemetrySource`; telemetry-fed scoring terms read one snapshot per scheduling cycle. Metric names are
free-form; the ones octacloud's monitoring exports are listed in :data:`KNOWN_METRICS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, runtime_checkable

NodeTelemetry = Mapping[str, Mapping[str, float]]
"""Node name → metric name → value."""

KNOWN_METRICS: Mapping[str, str] = MappingProxyType(
    {
        "gpu_utilisation": "mean SM utilisation of the node's cards, 0..1",
        "gpu_memory_bandwidth": "mean memory-bandwidth utilisation of the node's cards, 0..1",
        "pcie_throughput": "PCIe throughput utilisation, 0..1",
        "network_latency_us": "round trip to the gateway (least TCP handshake to the node's replicas), µs",
        "network_load": "NIC utilisation, 0..1",
        "power_price": "electricity price at the node's site now, per kWh (the fleet file's tariff)",
        "power_cost": "power_price × the measured power_draw_w / 1000: what running the node costs per hour now",
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
        """A new snapshot with ``node``'s ``metrics`` changed (the one handed out before stays as it was, so a
        consumer that keeps it, as :class:`PricedTelemetry` does, sees the change as a new snapshot)."""
        values = dict(self._values)
        values[node] = {**values.get(node, {}), **metrics}
        self._values = values


class MeasuredNetwork:
    """``source``'s snapshot with each node's ``network_latency_us`` as ``latency()`` measures it now (the gateway's
    round trips to the node's replicas); nodes not measured keep what ``source`` says. A snapshot is computed
    once per pair of (source snapshot, latency mapping) objects: the prober replaces its mapping each round."""

    def __init__(self, source: TelemetrySource, latency: Callable[[], Mapping[str, float]]) -> None:
        self.source, self.latency = source, latency
        self._last: tuple[NodeTelemetry, Mapping[str, float], NodeTelemetry] | None = None

    def snapshot(self) -> NodeTelemetry:
        base, measured = self.source.snapshot(), self.latency()
        if not measured:
            return base
        if self._last is not None and self._last[0] is base and self._last[1] is measured:
            return self._last[2]
        out = {node: dict(metrics) for node, metrics in base.items()}
        for node, us in measured.items():
            out.setdefault(node, {})["network_latency_us"] = float(us)
        self._last = (base, measured, out)
        return out


MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True, slots=True)
class Tariff:
    """Electricity price per kWh by time of day (UTC): each step's price holds from its minute of the day until
    the next step's; before the first step the last one's still holds (the day wraps)."""

    steps: tuple[tuple[int, float], ...]
    """(minute of the day 0..1439, price) pairs, minutes increasing, at least one."""

    def __post_init__(self) -> None:
        minutes = [m for m, _ in self.steps]
        if not self.steps or minutes != sorted(set(minutes)) or not all(0 <= m < MINUTES_PER_DAY for m in minutes):
            raise ValueError(f"tariff steps must be distinct minutes 0..1439 in order, got {minutes}")

    def price_at(self, unix_seconds: float) -> float:
        """The price at wall-clock time ``unix_seconds`` (UTC)."""
        minute = int(unix_seconds // 60) % MINUTES_PER_DAY
        price = self.steps[-1][1]
        for start, p in self.steps:
            if start > minute:
                break
            price = p
        return price


class PricedTelemetry:
    """``source``'s snapshot with, for every node that has a tariff, ``power_price`` now (per kWh) and, where the
    node's draw is measured, ``power_cost``: that price × ``power_draw_w`` / 1000, what running the node costs
    per hour now. Snapshots of one source sample in one minute are computed once."""

    def __init__(self, source: TelemetrySource, tariffs: Mapping[str, Tariff], now: Callable[[], float]) -> None:
        self.source, self.tariffs, self.now = source, dict(tariffs), now
        self._last: tuple[NodeTelemetry, int, NodeTelemetry] | None = None

    def snapshot(self) -> NodeTelemetry:
        base = self.source.snapshot()
        if not self.tariffs:
            return base
        t = self.now()
        minute = int(t // 60)
        if self._last is not None and self._last[0] is base and self._last[1] == minute:
            return self._last[2]
        out = {node: dict(metrics) for node, metrics in base.items()}
        for node, tariff in self.tariffs.items():
            metrics = out.setdefault(node, {})
            price = metrics["power_price"] = tariff.price_at(t)
            draw = metrics.get("power_draw_w")
            if draw is not None:
                metrics["power_cost"] = price * draw / 1000.0
        self._last = (base, minute, out)
        return out
