"""The cloud's monitor: one loop that samples telemetry and keeps the short history the dashboard draws.

Every ``interval_s`` (1 s by default) :meth:`CloudMonitor.tick` takes a telemetry sample, measures the
scheduler's state (allocation and fragmentation, the latter as FGD defines it for the product's slice sizes) and
turns the gateway's cumulative per-deployment counters into rates (requests per second, mean latency, errors
per second). The last ``history_points`` values of each are kept in memory: enough for the dashboard's charts
(15 minutes at 1 s), not a metrics store — Prometheus is that.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from octacloud.core.clock import Clock
from octacloud.observability.generation import figures
from octacloud.observability.telemetry import FleetSample, TelemetrySampler
from octacloud.scheduler.fragmentation import FragmentationTracker, TargetWorkload
from octacloud.scheduler.framework.state import ClusterState

log = logging.getLogger("octacloud.observability.monitor")


class GatewayCountersLike(Protocol):
    """What the gateway counts per deployment (``octacloud.gateway.routing.DeploymentCounters``).
    All but ``outstanding`` are cumulative and never decrease."""

    @property
    def requests(self) -> int: ...

    @property
    def failures(self) -> int: ...

    @property
    def bytes_in(self) -> int: ...

    @property
    def bytes_out(self) -> int: ...

    @property
    def latency_us_total(self) -> int: ...

    @property
    def outstanding(self) -> int: ...


GatewaySource = Callable[[], Mapping[str, GatewayCountersLike]]


@dataclass(slots=True)
class Series:
    """A bounded time series of ``(wall-clock seconds, value)``."""

    points: deque[tuple[float, float]]

    @classmethod
    def bounded(cls, size: int) -> Series:
        return cls(deque(maxlen=size))

    def add(self, at: float, value: float) -> None:
        self.points.append((at, value))

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None


@dataclass(slots=True)
class DeploymentLoad:
    """Rates of one deployment as the gateway measured them."""

    qps: Series
    latency_ms: Series
    errors_per_s: Series
    _last: tuple[float, int, int, int] | None = None
    """(monotonic, requests, failures, latency_us_total) at the previous tick."""
    tokens_per_s: Series | None = None
    """A generative deployment's generated tokens per second, summed over its replicas' scraped counters."""
    _tokens: tuple[float, float] | None = None


StateSource = Callable[[], ClusterState]
"""The scheduler's current state (the cloud may replace it when the fleet changes)."""


@dataclass(slots=True)
class CloudMonitor:
    state_source: StateSource
    workload: TargetWorkload
    sampler: TelemetrySampler
    gateway: GatewaySource
    clock: Clock
    interval_s: float = 1.0
    history_points: int = 900
    allocation: Series = field(init=False)
    """Allocated share of the fleet's milli-GPU, 0..1."""
    fragmentation: Series = field(init=False)
    """Fragmented share of the idle milli-GPU, 0..1 (FGD's fragmentation rate)."""
    load: dict[str, DeploymentLoad] = field(default_factory=dict)
    _tracker: FragmentationTracker | None = field(default=None, init=False)
    ticks: int = 0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"monitor interval must be > 0 seconds, got {self.interval_s}")
        if self.history_points < 2:
            raise ValueError(f"history must keep at least 2 points, got {self.history_points}")
        self.allocation = Series.bounded(self.history_points)
        self.fragmentation = Series.bounded(self.history_points)

    @property
    def state(self) -> ClusterState:
        return self.state_source()

    @property
    def latest(self) -> FleetSample | None:
        return self.sampler.latest

    @property
    def tracker(self) -> FragmentationTracker:
        """Per-node fragmentation of the current scheduler state (rebuilt when the cloud replaces the state)."""
        state = self.state_source()
        if self._tracker is None or self._tracker.state is not state:
            self._tracker = FragmentationTracker(state, self.workload)
        return self._tracker

    def fragmentation_milli(self) -> float:
        """Fragmented milli-GPU now (FGD's measure over the target workload)."""
        return self.tracker.refresh()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set; a failed tick is logged, never fatal."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("monitoring tick failed")
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        await self.sampler.sample()
        now, wall = self.clock.monotonic(), self.clock.time()
        self.fragmentation_milli()
        state = self.tracker.state
        total = state.total_gpu_milli
        self.allocation.add(wall, state.allocated_gpu_milli / total if total else 0.0)
        self.fragmentation.add(wall, self.tracker.rate())
        counters = self.gateway()
        for name in list(self.load):
            if name not in counters:
                del self.load[name]
        for name, c in counters.items():
            load = self.load.get(name)
            if load is None:
                load = self.load[name] = DeploymentLoad(
                    Series.bounded(self.history_points),
                    Series.bounded(self.history_points),
                    Series.bounded(self.history_points),
                )
            if load._last is not None and now > load._last[0]:
                dt = now - load._last[0]
                n = c.requests - load._last[1]
                load.qps.add(wall, max(0, n) / dt)
                load.errors_per_s.add(wall, max(0, c.failures - load._last[2]) / dt)
                load.latency_ms.add(wall, (c.latency_us_total - load._last[3]) / 1000 / n if n > 0 else 0.0)
            load._last = (now, c.requests, c.failures, c.latency_us_total)
        self._generation(now, wall)
        self.ticks += 1

    def _generation(self, now: float, wall: float) -> None:
        """Generated tokens per second per generative deployment, from the replicas scraped this tick."""
        sample = self.latest
        if sample is None:
            return
        tokens: dict[str, float] = {}
        for r in sample.replicas.values():
            found = figures(r.serving.families) if r.serving is not None else None
            if found is not None:
                tokens[r.info.deployment] = tokens.get(r.info.deployment, 0.0) + found.generation_tokens
        for name, total in tokens.items():
            load = self.load.get(name)
            if load is None:
                continue
            if load.tokens_per_s is None:
                load.tokens_per_s = Series.bounded(self.history_points)
            if load._tokens is not None and now > load._tokens[0]:
                load.tokens_per_s.add(wall, max(0.0, total - load._tokens[1]) / (now - load._tokens[0]))
            load._tokens = (now, total)
