"""The telemetry sampler: per-card and per-replica measurements every second, and the scheduler's view of them.

Each :meth:`TelemetrySampler.sample` reads, at one moment of the injected clock:

* every NVIDIA card of this host through NVML (:mod:`octacloud.observability.dcgm`), under dcgm-exporter's names;
* every replica: its process's CPU time and memory, and (scraped over HTTP) its Triton metrics and statistics;
* for "cards" that are really shares of the host's CPU (machines without GPUs), the replica-measured
  equivalents under octacloud's names (``octacloud_cpu_card_*``), never DCGM's.

The sampler is a :class:`~octacloud.scheduler.telemetry.TelemetrySource`: :meth:`snapshot` returns the latest
sample's node metrics (``gpu_utilisation``, ``gpu_memory_bandwidth``, ``pcie_throughput``, ``power_draw_w``,
``temperature_c``, ``ecc_errors``, ``cpu_utilisation``, and given a NIC reader ``network_load``) without I/O, and
nothing once the sample is older than ``max_age_s``, so the 5-second scheduling loop never scores on stale numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from octacloud.core.clock import Clock
from octacloud.core.model import Node
from octacloud.observability import dcgm
from octacloud.observability.dcgm import CardIdentity, NvmlCards
from octacloud.observability.nic import NicLoad
from octacloud.observability.replicas import (
    ProcessReader,
    ReplicaInfo,
    ReplicaServing,
    ReplicaSource,
    Scraper,
    read_process,
)
from octacloud.scheduler.telemetry import NodeTelemetry

log = logging.getLogger("octacloud.observability.telemetry")

CPU_BUSY = "octacloud_cpu_card_busy_ratio"
CPU_CORES = "octacloud_cpu_card_cpu_ratio"
CPU_MEMORY_USED = "octacloud_cpu_card_memory_used_bytes"
CPU_MEMORY_FREE = "octacloud_cpu_card_memory_free_bytes"
CPU_FIELDS: Mapping[str, str] = {
    CPU_BUSY: "Share of the last interval the card's replicas spent executing batches (from their statistics' "
    "compute durations); the CPU machine's stand-in for DCGM_FI_DEV_GPU_UTIL / 100. Above 1 when batches overlap.",
    CPU_CORES: "CPU time the card's replica processes used in the last interval, over the cores the card stands "
    "for (from /proc); 1 = every core of the card busy.",
    CPU_MEMORY_USED: "Resident memory of the card's replica processes, in bytes (stand-in for DCGM_FI_DEV_FB_USED).",
    CPU_MEMORY_FREE: "The card's memory share minus CPU_MEMORY_USED, in bytes, never below 0.",
}
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CardKey:
    node: str
    gpu: int


@dataclass(slots=True)
class CardTelemetry:
    """One card's measurements. ``source`` is ``nvml`` (``values`` keyed by DCGM field names) or ``replicas``
    (a CPU "card": ``values`` keyed by the ``octacloud_cpu_card_*`` names)."""

    node: str
    gpu: int
    model: str
    source: str
    values: dict[str, float] = field(default_factory=dict)
    identity: CardIdentity | None = None
    replicas: tuple[str, ...] = ()
    deployments: tuple[str, ...] = ()


@dataclass(slots=True)
class ReplicaTelemetry:
    info: ReplicaInfo
    busy_ratio: float | None = None
    """Share of the interval spent executing batches."""
    cpu_cores: float | None = None
    """CPU seconds per second used by the process over the interval."""
    cpu_seconds: float | None = None
    rss_bytes: int | None = None
    serving: ReplicaServing | None = None
    gpu_busy: float | None = None
    """Cards' worth of SM time the replica's process used over NVML's last sample period (NVML process samples,
    summed over its cards: 0.5 = half of one card). None off NVIDIA cards or when NVML has no sample for it."""
    gpu_memory_bytes: int | None = None
    """Framebuffer memory the replica's process holds, summed over its cards (NVML)."""


@dataclass(slots=True)
class FleetSample:
    at: float
    """Wall-clock time of the sample (seconds since the epoch)."""
    monotonic: float
    cards: dict[CardKey, CardTelemetry] = field(default_factory=dict)
    replicas: dict[str, ReplicaTelemetry] = field(default_factory=dict)
    nodes: dict[str, dict[str, float]] = field(default_factory=dict)
    """The scheduler's node metrics derived from this sample."""


@dataclass(slots=True)
class _Previous:
    """A replica's last measurements, each with the moment it was taken (a failed scrape keeps the older one)."""

    pid: int | None
    cpu: tuple[float, float] | None = None
    """(monotonic, CPU seconds)."""
    execution: tuple[float, int] | None = None
    """(monotonic, execution ns)."""
    serving: tuple[float, ReplicaServing] | None = None
    """(monotonic, last successful scrape)."""
    busy: tuple[float, float] | None = None
    """(monotonic, last busy ratio measured)."""


class TelemetrySampler:
    """Samples the fleet's cards and replicas; see the module docstring.

    ``nodes`` returns the fleet now (it changes as nodes join); ``nvml_node`` names the fleet node whose cards
    NVML reads (this host); ``cpu_card_model`` is the model name of CPU "cards". ``max_age_s`` bounds how old a
    sample the scheduler may see. ``nic`` measures this host's NIC load (:mod:`octacloud.observability.nic`): given
    when every node of the fleet runs on this host (the local launcher's), each of them reports it.
    """

    def __init__(
        self,
        nodes: Callable[[], Sequence[Node]],
        replicas: ReplicaSource,
        clock: Clock,
        *,
        nvml: NvmlCards | None = None,
        nvml_node: str | None = None,
        cpu_card_model: str = "cpu",
        scraper: Scraper | None = None,
        processes: ProcessReader = read_process,
        interval_s: float = 1.0,
        max_age_s: float | None = None,
        on_readings: Callable[[list[dcgm.CardReading]], None] | None = None,
        nic: NicLoad | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"telemetry interval must be > 0 seconds, got {interval_s}")
        self.nodes = nodes
        self.replicas = replicas
        self.clock = clock
        self.nvml = nvml
        self.nvml_node = nvml_node
        self.cpu_card_model = cpu_card_model
        self.scraper = scraper
        self.processes = processes
        self.interval_s = interval_s
        self.max_age_s = max_age_s if max_age_s is not None else 3 * interval_s
        self.on_readings = on_readings
        self.nic = nic
        """Called with every sample's raw NVML readings (their fresh XIDs, a lost GPU): the card-health watch."""
        self.latest: FleetSample | None = None
        self._previous: dict[str, _Previous] = {}

    # ---- the scheduler's view ----------------------------------------------------------------------------

    def snapshot(self) -> NodeTelemetry:
        latest = self.latest
        if latest is None or self.clock.monotonic() - latest.monotonic > self.max_age_s:
            return {}
        return latest.nodes

    # ---- sampling ------------------------------------------------------------------------------------------

    async def sample(self) -> FleetSample:
        now = self.clock.monotonic()
        replicas = list(self.replicas())
        serving = await self.scraper.scrape(replicas) if self.scraper is not None else {}
        readings, processes = (
            await asyncio.to_thread(self._read_nvml, self.nvml, now) if self.nvml is not None else ([], [])
        )
        network_load = self.nic.sample() if self.nic is not None else None
        sample = FleetSample(self.clock.time(), now)
        for r in replicas:
            sample.replicas[r.id] = self._replica(r, serving.get(r.id), now)
        self._attribute(sample, replicas, processes)
        if readings and self.on_readings is not None:
            try:
                self.on_readings(readings)
            except Exception:  # the watch must never cost the sample
                log.exception("card readings handler failed")
        self._previous = {k: v for k, v in self._previous.items() if k in sample.replicas}
        on_card: dict[CardKey, list[ReplicaInfo]] = {}
        for r in replicas:
            for g in r.gpus:
                on_card.setdefault(CardKey(r.node, g), []).append(r)
        by_index = {reading.card.index: reading for reading in readings}
        fleet = list(self.nodes())
        for node in fleet:
            for gpu in node.gpus:
                key = CardKey(node.name, gpu.index)
                here = on_card.get(key, [])
                card = CardTelemetry(
                    node.name,
                    gpu.index,
                    gpu.model,
                    "",
                    replicas=tuple(sorted(r.id for r in here)),
                    deployments=tuple(sorted({r.deployment for r in here})),
                )
                reading = by_index.get(gpu.index) if node.name == self.nvml_node else None
                if reading is not None:
                    card.source, card.identity, card.values = "nvml", reading.card, reading.values
                elif gpu.model == self.cpu_card_model:
                    card.source = "replicas"
                    card.values = self._cpu_card(node, gpu.memory_mib, here, sample)
                else:
                    continue  # a GPU of another host: its own node's sampler reports it
                sample.cards[key] = card
        sample.nodes = self._node_metrics(sample)
        if network_load is not None:
            for node in fleet:
                sample.nodes.setdefault(node.name, {})["network_load"] = network_load
        self.latest = sample
        return sample

    @staticmethod
    def _read_nvml(nvml: NvmlCards, now: float) -> tuple[list[dcgm.CardReading], list[dcgm.ProcessUse]]:
        return nvml.read(now), nvml.processes()

    def _attribute(
        self, sample: FleetSample, replicas: Sequence[ReplicaInfo], processes: Sequence[dcgm.ProcessUse]
    ) -> None:
        """Give each replica on this host's NVIDIA cards what NVML saw its process use there."""
        by_pid: dict[int, list[dcgm.ProcessUse]] = {}
        for use in processes:
            by_pid.setdefault(use.pid, []).append(use)
        for r in replicas:
            if r.node != self.nvml_node or r.pid is None:
                continue
            uses = [u for u in by_pid.get(r.pid, ()) if u.gpu in r.gpus]
            if not uses:
                continue
            t = sample.replicas[r.id]
            sm = [u.sm_percent for u in uses if u.sm_percent is not None]
            t.gpu_busy = sum(sm) / 100.0 if sm else None
            memory = [u.memory_bytes for u in uses if u.memory_bytes is not None]
            t.gpu_memory_bytes = sum(memory) if memory else None

    def gpu_use(self) -> dict[str, int]:
        """Replica id → milli-GPU it is using now (its NVML-measured SM share), for the ledger's GPU-used
        metric; replicas with no measurement are absent. Nothing once the latest sample is stale."""
        latest = self.latest
        if latest is None or self.clock.monotonic() - latest.monotonic > self.max_age_s:
            return {}
        return {rid: round(t.gpu_busy * 1000) for rid, t in latest.replicas.items() if t.gpu_busy is not None}

    def card_power(self) -> dict[tuple[str, int], float]:
        """(node, card index) → watts the card draws now (NVML), for the ledger's energy; cards without a
        measured draw are absent. Nothing once the latest sample is stale."""
        latest = self.latest
        if latest is None or self.clock.monotonic() - latest.monotonic > self.max_age_s:
            return {}
        return {
            (k.node, k.gpu): card.values[dcgm.POWER]
            for k, card in latest.cards.items()
            if card.source == "nvml" and dcgm.POWER in card.values
        }

    def _replica(self, r: ReplicaInfo, serving: ReplicaServing | None, now: float) -> ReplicaTelemetry:
        last = self._previous.get(r.id)
        if last is None or last.pid != r.pid:  # new, or restarted: its counters began again
            last = self._previous[r.id] = _Previous(r.pid)
        if serving is None and last.serving is not None and now - last.serving[0] <= self.max_age_s:
            serving = last.serving[1]  # one slow scrape must not blank the dashboard: reuse a recent one
        elif serving is not None:
            last.serving = (now, serving)
        out = ReplicaTelemetry(r, serving=serving)
        proc = self.processes(r.pid) if r.pid is not None else None
        if proc is not None:
            out.cpu_seconds, out.rss_bytes = proc.cpu_seconds, proc.rss_bytes
            if last.cpu is not None and now > last.cpu[0]:
                out.cpu_cores = max(0.0, proc.cpu_seconds - last.cpu[1]) / (now - last.cpu[0])
            last.cpu = (now, proc.cpu_seconds)
        if serving is not None and last.serving is not None and last.serving[0] == now:
            if last.execution is not None and now > last.execution[0]:
                busy = max(0, serving.execution_ns - last.execution[1]) / 1e9 / (now - last.execution[0])
                last.busy = (now, busy)
            last.execution = (now, serving.execution_ns)
        if last.busy is not None and now - last.busy[0] <= self.max_age_s:
            out.busy_ratio = last.busy[1]
        return out

    def _cpu_card(
        self, node: Node, memory_mib: int, here: Sequence[ReplicaInfo], sample: FleetSample
    ) -> dict[str, float]:
        """The replica-measured equivalents for one CPU "card" (a multi-card replica counts 1/n on each)."""
        cores = node.cpu_milli / 1000 / max(1, len(node.gpus))
        busy = cpu = 0.0
        rss = 0
        measured_busy = measured_cpu = False
        for r in here:
            t = sample.replicas[r.id]
            share = 1 / len(r.gpus)
            if t.busy_ratio is not None:
                busy += t.busy_ratio * share
                measured_busy = True
            if t.cpu_cores is not None:
                cpu += t.cpu_cores * share
                measured_cpu = True
            if t.rss_bytes is not None:
                rss += int(t.rss_bytes * share)
        values = {CPU_MEMORY_USED: float(rss), CPU_MEMORY_FREE: float(max(0, memory_mib * _MIB - rss))}
        if measured_busy or not here:  # an empty card is measurably idle
            values[CPU_BUSY] = busy
        if measured_cpu or not here:
            values[CPU_CORES] = cpu / cores if cores > 0 else 0.0
        return values

    @staticmethod
    def _node_metrics(sample: FleetSample) -> dict[str, dict[str, float]]:
        grouped: dict[str, list[CardTelemetry]] = {}
        for card in sample.cards.values():
            grouped.setdefault(card.node, []).append(card)
        out: dict[str, dict[str, float]] = {}
        for node, cards in grouped.items():
            metrics: dict[str, float] = {}
            ratios: dict[str, list[float]] = {}
            for card in cards:
                if card.source == "nvml":
                    reading = dcgm.CardReading(card.identity, card.values) if card.identity else None
                    for k, v in (reading.utilisation() if reading else {}).items():
                        ratios.setdefault(k, []).append(v)
                else:
                    if CPU_BUSY in card.values:
                        ratios.setdefault("gpu_utilisation", []).append(min(1.0, card.values[CPU_BUSY]))
                    if CPU_CORES in card.values:
                        ratios.setdefault("cpu_utilisation", []).append(min(1.0, card.values[CPU_CORES]))
            for k, vs in ratios.items():
                metrics[k] = sum(vs) / len(vs)
            nvml = [c.values for c in cards if c.source == "nvml"]
            if any(dcgm.POWER in v for v in nvml):
                metrics["power_draw_w"] = sum(v.get(dcgm.POWER, 0.0) for v in nvml)
            if any(dcgm.GPU_TEMP in v for v in nvml):
                metrics["temperature_c"] = max(v[dcgm.GPU_TEMP] for v in nvml if dcgm.GPU_TEMP in v)
            if any(dcgm.ECC_SBE in v for v in nvml):
                metrics["ecc_errors"] = sum(v.get(dcgm.ECC_SBE, 0.0) for v in nvml)
            out[node] = metrics
        return out

    async def close(self) -> None:
        if self.scraper is not None:
            await self.scraper.close()
        if self.nvml is not None:
            self.nvml.close()
