"""GPU telemetry through NVML (``nvidia-ml-py``), under the field names NVIDIA's dcgm-exporter uses.

:class:`NvmlCards` opens NVML once, learns each card's identity (index, UUID, model, PCI bus, PCIe link) and on
every :meth:`NvmlCards.read` returns one :class:`CardReading` per card: a dict from dcgm-exporter field name to
value, in dcgm-exporter's units (percent, MiB, watts, degrees Celsius, MHz, bytes per second). A field the card
does not support (``NVMLError_NotSupported``: ECC on consumer cards, NVLink on PCIe cards) is left out rather than
reported as zero. XID errors arrive as NVML events; the reader polls its event set without waiting and reports
the last XID seen, as dcgm-exporter does.

The NVML module is injected (``nvml=``) so that tests run against a fake; by default ``pynvml`` is imported
lazily, and :func:`open_nvml` returns None on a machine without NVIDIA GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

log = logging.getLogger("octacloud.observability.dcgm")

# dcgm-exporter field names (its default counters plus the profiling fields for PCIe and NVLink).
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
PCIE_TX = "DCGM_FI_PROF_PCIE_TX_BYTES"
PCIE_RX = "DCGM_FI_PROF_PCIE_RX_BYTES"
NVLINK_TX = "DCGM_FI_PROF_NVLINK_TX_BYTES"
NVLINK_RX = "DCGM_FI_PROF_NVLINK_RX_BYTES"
POWER = "DCGM_FI_DEV_POWER_USAGE"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
MEM_CLOCK = "DCGM_FI_DEV_MEM_CLOCK"
ECC_SBE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
XID = "DCGM_FI_DEV_XID_ERRORS"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
ENC_UTIL = "DCGM_FI_DEV_ENC_UTIL"
DEC_UTIL = "DCGM_FI_DEV_DEC_UTIL"
PCIE_REPLAY = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
PCIE_LINK_GEN = "DCGM_FI_DEV_PCIE_LINK_GEN"
PCIE_LINK_WIDTH = "DCGM_FI_DEV_PCIE_LINK_WIDTH"
VIDEO_CLOCK = "DCGM_FI_DEV_VIDEO_CLOCK"
MAX_SM_CLOCK = "DCGM_FI_DEV_MAX_SM_CLOCK"
MAX_MEM_CLOCK = "DCGM_FI_DEV_MAX_MEM_CLOCK"
THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
POWER_LIMIT = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
ENFORCED_POWER_LIMIT = "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"
FAN_SPEED = "DCGM_FI_DEV_FAN_SPEED"
PSTATE = "DCGM_FI_DEV_PSTATE"
COMPUTE_MODE = "DCGM_FI_DEV_COMPUTE_MODE"
PERSISTENCE_MODE = "DCGM_FI_DEV_PERSISTENCE_MODE"
BAR1_TOTAL = "DCGM_FI_DEV_BAR1_TOTAL"
BAR1_USED = "DCGM_FI_DEV_BAR1_USED"
BAR1_FREE = "DCGM_FI_DEV_BAR1_FREE"
ECC_SBE_AGG = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
ECC_DBE_AGG = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
RETIRED_SBE = "DCGM_FI_DEV_RETIRED_SBE"
RETIRED_DBE = "DCGM_FI_DEV_RETIRED_DBE"
RETIRED_PENDING = "DCGM_FI_DEV_RETIRED_PENDING"
REMAP_CORRECTABLE = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
REMAP_UNCORRECTABLE = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
POWER_VIOLATION = "DCGM_FI_DEV_POWER_VIOLATION"
THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"
SYNC_BOOST_VIOLATION = "DCGM_FI_DEV_SYNC_BOOST_VIOLATION"
BOARD_LIMIT_VIOLATION = "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION"
LOW_UTIL_VIOLATION = "DCGM_FI_DEV_LOW_UTIL_VIOLATION"
RELIABILITY_VIOLATION = "DCGM_FI_DEV_RELIABILITY_VIOLATION"

FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        GPU_UTIL: ("gauge", "GPU utilization (in %)."),
        MEM_COPY_UTIL: ("gauge", "Memory utilization (in %): share of time device memory was read or written."),
        FB_USED: ("gauge", "Framebuffer memory used (in MiB)."),
        FB_FREE: ("gauge", "Framebuffer memory free (in MiB)."),
        PCIE_TX: ("gauge", "The rate of data transmitted over the PCIe bus, in bytes per second."),
        PCIE_RX: ("gauge", "The rate of data received over the PCIe bus, in bytes per second."),
        NVLINK_TX: ("gauge", "The rate of data transmitted over NVLink (all links), in bytes per second."),
        NVLINK_RX: ("gauge", "The rate of data received over NVLink (all links), in bytes per second."),
        POWER: ("gauge", "Power draw (in W)."),
        ENERGY: ("counter", "Total energy consumption since boot (in mJ)."),
        GPU_TEMP: ("gauge", "GPU temperature (in C)."),
        SM_CLOCK: ("gauge", "SM clock frequency (in MHz)."),
        MEM_CLOCK: ("gauge", "Memory clock frequency (in MHz)."),
        ECC_SBE: ("counter", "Total number of single-bit volatile ECC errors."),
        ECC_DBE: ("counter", "Total number of double-bit volatile ECC errors."),
        XID: ("gauge", "Value of the last XID error encountered (0: none)."),
        FB_TOTAL: ("gauge", "Framebuffer memory total (in MiB)."),
        ENC_UTIL: ("gauge", "Encoder utilization (in %)."),
        DEC_UTIL: ("gauge", "Decoder utilization (in %)."),
        PCIE_REPLAY: ("counter", "Total number of PCIe retries."),
        PCIE_LINK_GEN: ("gauge", "PCIe current link generation."),
        PCIE_LINK_WIDTH: ("gauge", "PCIe current link width (lanes)."),
        VIDEO_CLOCK: ("gauge", "Video encoder/decoder clock frequency (in MHz)."),
        MAX_SM_CLOCK: ("gauge", "Maximum SM clock frequency (in MHz)."),
        MAX_MEM_CLOCK: ("gauge", "Maximum memory clock frequency (in MHz)."),
        THROTTLE: ("gauge", "Current clock throttle reasons (bitmask of NVML's nvmlClocksThrottleReasons)."),
        POWER_LIMIT: ("gauge", "Power management limit (in W)."),
        ENFORCED_POWER_LIMIT: ("gauge", "Power limit the driver enforces (in W)."),
        FAN_SPEED: ("gauge", "Fan speed (in % of the maximum)."),
        PSTATE: ("gauge", "Performance state (P-state, 0 = maximum performance)."),
        COMPUTE_MODE: ("gauge", "Compute mode (0 default, 2 prohibited, 3 exclusive process)."),
        PERSISTENCE_MODE: ("gauge", "Persistence mode (1 = enabled)."),
        BAR1_TOTAL: ("gauge", "BAR1 memory total (in MiB)."),
        BAR1_USED: ("gauge", "BAR1 memory used (in MiB)."),
        BAR1_FREE: ("gauge", "BAR1 memory free (in MiB)."),
        ECC_SBE_AGG: ("counter", "Total number of single-bit persistent ECC errors."),
        ECC_DBE_AGG: ("counter", "Total number of double-bit persistent ECC errors."),
        RETIRED_SBE: ("counter", "Total number of retired pages due to single-bit errors."),
        RETIRED_DBE: ("counter", "Total number of retired pages due to double-bit errors."),
        RETIRED_PENDING: ("counter", "Total number of pages pending retirement."),
        REMAP_CORRECTABLE: ("counter", "Number of remapped rows for correctable errors."),
        REMAP_UNCORRECTABLE: ("counter", "Number of remapped rows for uncorrectable errors."),
        REMAP_FAILURE: ("gauge", "Whether remapping of rows has failed."),
        POWER_VIOLATION: ("counter", "Throttling duration due to power constraints (in us)."),
        THERMAL_VIOLATION: ("counter", "Throttling duration due to thermal constraints (in us)."),
        SYNC_BOOST_VIOLATION: ("counter", "Throttling duration due to sync-boost constraints (in us)."),
        BOARD_LIMIT_VIOLATION: ("counter", "Throttling duration due to board limit constraints (in us)."),
        LOW_UTIL_VIOLATION: ("counter", "Throttling duration due to low utilization (in us)."),
        RELIABILITY_VIOLATION: ("counter", "Throttling duration due to reliability constraints (in us)."),
    }
)
"""Field name → (Prometheus type as dcgm-exporter declares it, help text)."""

LABELS = ("gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname")
"""dcgm-exporter's labels for a card; octacloud adds ``node``, ``replicas`` and ``deployments``."""

_PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969e6, 5: 3938e6, 6: 7877e6}
"""Usable bytes per second per lane and direction, by PCIe generation."""
_ALL_LINKS = 0xFFFFFFFF
"""NVML field scope that sums a per-link counter over every NVLink of the card."""
_MIB = 1024 * 1024
_LOST_ERRORS = frozenset({"NVMLError_GpuIsLost", "NVMLError_GpuNotFound", "NVMLError_ResetRequired"})
"""NVML errors that mean the card itself is gone, not that one field is unsupported."""


def _first_of(nvml: Any, *names: str) -> Callable[..., Any]:
    """The first of ``names`` this nvidia-ml-py has (NVML renames calls across driver generations)."""
    for name in names:
        call = getattr(nvml, name, None)
        if call is not None:
            return call  # type: ignore[no-any-return]
    raise AttributeError(names[0])


def _violation(policy: str) -> Callable[[Any, Any], float]:
    def read(nvml: Any, h: Any) -> float:
        status = nvml.nvmlDeviceGetViolationStatus(h, getattr(nvml, policy))
        return float(status.violationTime) / 1000.0  # ns -> us, as DCGM reports it

    return read


def _retired(cause: str) -> Callable[[Any, Any], float]:
    return lambda nvml, h: float(len(nvml.nvmlDeviceGetRetiredPages(h, getattr(nvml, cause))))


def _remapped(i: int) -> Callable[[Any, Any], float]:
    return lambda nvml, h: float(nvml.nvmlDeviceGetRemappedRows(h)[i])


_EXTENDED: tuple[tuple[str, Callable[[Any, Any], float]], ...] = (
    (FB_TOTAL, lambda nvml, h: float(nvml.nvmlDeviceGetMemoryInfo(h).total // _MIB)),
    (ENC_UTIL, lambda nvml, h: float(nvml.nvmlDeviceGetEncoderUtilization(h)[0])),
    (DEC_UTIL, lambda nvml, h: float(nvml.nvmlDeviceGetDecoderUtilization(h)[0])),
    (PCIE_REPLAY, lambda nvml, h: float(nvml.nvmlDeviceGetPcieReplayCounter(h))),
    (PCIE_LINK_GEN, lambda nvml, h: float(nvml.nvmlDeviceGetCurrPcieLinkGeneration(h))),
    (PCIE_LINK_WIDTH, lambda nvml, h: float(nvml.nvmlDeviceGetCurrPcieLinkWidth(h))),
    (VIDEO_CLOCK, lambda nvml, h: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_VIDEO))),
    (MAX_SM_CLOCK, lambda nvml, h: float(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM))),
    (MAX_MEM_CLOCK, lambda nvml, h: float(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM))),
    (
        THROTTLE,
        lambda nvml, h: float(
            _first_of(nvml, "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")(h)
        ),
    ),
    (POWER_LIMIT, lambda nvml, h: float(nvml.nvmlDeviceGetPowerManagementLimit(h)) / 1000.0),
    (ENFORCED_POWER_LIMIT, lambda nvml, h: float(nvml.nvmlDeviceGetEnforcedPowerLimit(h)) / 1000.0),
    (FAN_SPEED, lambda nvml, h: float(nvml.nvmlDeviceGetFanSpeed(h))),
    (PSTATE, lambda nvml, h: float(nvml.nvmlDeviceGetPerformanceState(h))),
    (COMPUTE_MODE, lambda nvml, h: float(nvml.nvmlDeviceGetComputeMode(h))),
    (PERSISTENCE_MODE, lambda nvml, h: float(nvml.nvmlDeviceGetPersistenceMode(h))),
    (BAR1_TOTAL, lambda nvml, h: float(nvml.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total // _MIB)),
    (BAR1_USED, lambda nvml, h: float(nvml.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used // _MIB)),
    (BAR1_FREE, lambda nvml, h: float(nvml.nvmlDeviceGetBAR1MemoryInfo(h).bar1Free // _MIB)),
    (
        ECC_SBE_AGG,
        lambda nvml, h: float(
            nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_AGGREGATE_ECC)
        ),
    ),
    (
        ECC_DBE_AGG,
        lambda nvml, h: float(
            nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_AGGREGATE_ECC)
        ),
    ),
    (RETIRED_SBE, _retired("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS")),
    (RETIRED_DBE, _retired("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")),
    (RETIRED_PENDING, lambda nvml, h: float(nvml.nvmlDeviceGetRetiredPagesPendingStatus(h))),
    (REMAP_CORRECTABLE, _remapped(0)),
    (REMAP_UNCORRECTABLE, _remapped(1)),
    (REMAP_FAILURE, _remapped(3)),
    (POWER_VIOLATION, _violation("NVML_PERF_POLICY_POWER")),
    (THERMAL_VIOLATION, _violation("NVML_PERF_POLICY_THERMAL")),
    (SYNC_BOOST_VIOLATION, _violation("NVML_PERF_POLICY_SYNC_BOOST")),
    (BOARD_LIMIT_VIOLATION, _violation("NVML_PERF_POLICY_BOARD_LIMIT")),
    (LOW_UTIL_VIOLATION, _violation("NVML_PERF_POLICY_LOW_UTILIZATION")),
    (RELIABILITY_VIOLATION, _violation("NVML_PERF_POLICY_RELIABILITY")),
)
"""Further dcgm-exporter fields, each one NVML call (a call this card, driver or nvidia-ml-py lacks leaves the
field out)."""


@dataclass(frozen=True, slots=True)
class CardIdentity:
    index: int
    uuid: str
    model: str
    pci_bus_id: str
    pcie_max_bytes_per_s: float | None
    """One direction's bandwidth of the card's current PCIe link (None when NVML cannot say)."""


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """What NVML saw one process use on one card: its SM utilisation over the last sample period (NVML's process
    utilisation samples; None when the card gives none) and its framebuffer memory (None when not reported)."""

    pid: int
    gpu: int
    sm_percent: float | None
    memory_bytes: int | None


@dataclass(slots=True)
class CardReading:
    """One card's fields at one moment (``values``: dcgm-exporter field name → value)."""

    card: CardIdentity
    values: dict[str, float] = field(default_factory=dict)
    xids: tuple[int, ...] = ()
    """XID errors NVML delivered for this card since the previous reading, oldest first."""
    lost: bool = False
    """NVML says the GPU is lost (fallen off the bus, or needs a reset): nothing on it can be trusted."""

    def utilisation(self) -> dict[str, float]:
        """The card's share of the scheduler's telemetry terms (0..1 ratios) that NVML could measure."""
        out: dict[str, float] = {}
        if GPU_UTIL in self.values:
            out["gpu_utilisation"] = self.values[GPU_UTIL] / 100.0
        if MEM_COPY_UTIL in self.values:
            out["gpu_memory_bandwidth"] = self.values[MEM_COPY_UTIL] / 100.0
        peak = self.card.pcie_max_bytes_per_s
        if peak and PCIE_TX in self.values and PCIE_RX in self.values:
            out["pcie_throughput"] = min(1.0, max(self.values[PCIE_TX], self.values[PCIE_RX]) / peak)
        return out


def open_nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None when NVML or NVIDIA GPUs are absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded ...: no NVIDIA GPUs here
        return None
    try:
        if pynvml.nvmlDeviceGetCount() > 0:
            return pynvml
    except Exception:
        pass
    pynvml.nvmlShutdown()
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlCards:
    """Reads every card of this host through an initialised NVML module; :meth:`close` shuts NVML down."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.cards = [self._identity(i, h) for i, h in enumerate(self.handles)]
        self._nvlink_last: dict[tuple[int, str], tuple[float, float]] = {}
        self._process_seen_us: dict[int, int] = {}
        """Card index → the newest process-utilisation sample already read (NVML returns samples after it)."""
        self._xid: dict[int, int] = {}
        """Card index → last XID, for the cards whose XID events NVML delivers (others report no XID field)."""
        self._events: Any = None
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("NVML events unavailable (%s): XID errors will not be reported", exc)
        if self._events is not None:
            for card, h in zip(self.cards, self.handles, strict=True):
                try:
                    nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
                except nvml.NVMLError:
                    continue
                self._xid[card.index] = 0

    def _identity(self, index: int, h: Any) -> CardIdentity:
        nvml = self.nvml
        pci = nvml.nvmlDeviceGetPciInfo(h)
        peak = None
        gen = self._supported(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
        width = self._supported(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h))
        if gen in _PCIE_LANE_BYTES_PER_S and width:
            peak = _PCIE_LANE_BYTES_PER_S[int(gen)] * int(width)
        return CardIdentity(
            index,
            _text(nvml.nvmlDeviceGetUUID(h)),
            _text(nvml.nvmlDeviceGetName(h)),
            _text(pci.busId),
            peak,
        )

    def _supported(self, call: Callable[[], Any]) -> Any:
        """``call()``, or None when the card does not support it (any NVML error: not supported, no permission,
        GPU lost — one missing field must not cost the others; or a call this nvidia-ml-py does not have)."""
        try:
            return call()
        except (self.nvml.NVMLError, AttributeError):
            return None

    def read(self, now: float) -> list[CardReading]:
        """One reading per card; ``now`` (monotonic seconds) turns NVLink byte counters into rates."""
        fresh = self._drain_xid_events()
        readings = [self._read(card, h, now) for card, h in zip(self.cards, self.handles, strict=True)]
        for reading in readings:
            reading.xids = tuple(xid for index, xid in fresh if index == reading.card.index)
        return readings

    def _read(self, card: CardIdentity, h: Any, now: float) -> CardReading:
        nvml, get = self.nvml, self._supported
        values: dict[str, float] = {}
        util = get(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            values[GPU_UTIL], values[MEM_COPY_UTIL] = float(util.gpu), float(util.memory)
        memory = None
        lost = False
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(h)
        except nvml.NVMLError as exc:
            lost = type(exc).__name__ in _LOST_ERRORS
        if memory is not None:
            values[FB_USED], values[FB_FREE] = memory.used // _MIB, memory.free // _MIB
        for name, counter in ((PCIE_TX, nvml.NVML_PCIE_UTIL_TX_BYTES), (PCIE_RX, nvml.NVML_PCIE_UTIL_RX_BYTES)):
            kib_per_s = get(partial(nvml.nvmlDeviceGetPcieThroughput, h, counter))
            if kib_per_s is not None:
                values[name] = float(kib_per_s) * 1024
        self._nvlink(card.index, h, now, values)
        scalar: tuple[tuple[str, Callable[[], Any], float], ...] = (
            (POWER, lambda: nvml.nvmlDeviceGetPowerUsage(h), 1e-3),
            (ENERGY, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h), 1.0),
            (GPU_TEMP, lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU), 1.0),
            (SM_CLOCK, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), 1.0),
            (MEM_CLOCK, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM), 1.0),
            (
                ECC_SBE,
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
                ),
                1.0,
            ),
            (
                ECC_DBE,
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                ),
                1.0,
            ),
        )
        for name, call, scale in scalar:
            value = get(call)
            if value is not None:
                values[name] = float(value) * scale
        for name, read in _EXTENDED:
            value = get(partial(read, nvml, h))
            if value is not None:
                values[name] = value
        if self._events is not None and card.index in self._xid:
            values[XID] = float(self._xid[card.index])
        return CardReading(card, values, lost=lost)

    def _call(self, name: str, *args: Any) -> Any:
        return getattr(self.nvml, name)(*args)  # AttributeError where this nvidia-ml-py lacks the call

    def processes(self) -> list[ProcessUse]:
        """Every compute process on every card (MPS clients included) with its SM utilisation since the last call
        and its memory: what the ledger bills as GPU time actually used."""
        out: list[ProcessUse] = []
        for card, h in zip(self.cards, self.handles, strict=True):
            memory: dict[int, int | None] = {}
            for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
                for proc in self._supported(partial(self._call, call, h)) or ():
                    used = getattr(proc, "usedGpuMemory", None)
                    memory[int(proc.pid)] = int(used) if isinstance(used, int) else memory.get(int(proc.pid))
            sm: dict[int, list[float]] = {}
            since = self._process_seen_us.get(card.index, 0)
            for sample in self._supported(partial(self.nvml.nvmlDeviceGetProcessUtilization, h, since)) or ():
                if int(sample.timeStamp) <= since:
                    continue
                sm.setdefault(int(sample.pid), []).append(float(sample.smUtil))
                self._process_seen_us[card.index] = max(self._process_seen_us.get(card.index, 0), int(sample.timeStamp))
            for pid in sorted(memory.keys() | sm.keys()):
                samples = sm.get(pid)
                mean = sum(samples) / len(samples) if samples else None
                out.append(ProcessUse(pid, card.index, mean, memory.get(pid)))
        return out

    def _nvlink(self, index: int, h: Any, now: float, values: dict[str, float]) -> None:
        nvml = self.nvml
        fields = [
            (NVLINK_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
            (NVLINK_RX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
        ]
        results = self._supported(lambda: nvml.nvmlDeviceGetFieldValues(h, [(f, _ALL_LINKS) for _, f in fields]))
        if results is None:
            return
        for (name, _), result in zip(fields, results, strict=True):
            if result.nvmlReturn != nvml.NVML_SUCCESS:
                continue
            kib = float(result.value.ullVal)
            last = self._nvlink_last.get((index, name))
            self._nvlink_last[(index, name)] = (now, kib)
            if last is not None and now > last[0] and kib >= last[1]:
                values[name] = (kib - last[1]) * 1024 / (now - last[0])

    def _drain_xid_events(self) -> list[tuple[int, int]]:
        """(card index, XID) of every event waiting, oldest first."""
        fresh: list[tuple[int, int]] = []
        if self._events is None:
            return fresh
        nvml = self.nvml
        for _ in range(1024):  # bounded: a storm of events must not stall the sampler
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return fresh
            except nvml.NVMLError as exc:
                log.warning("NVML event wait failed (%s): XID reporting stops", exc)
                self._events = None
                return fresh
            index = self._supported(partial(nvml.nvmlDeviceGetIndex, event.device))
            if index is not None and int(index) in self._xid:
                self._xid[int(index)] = int(event.eventData)
                fresh.append((int(index), int(event.eventData)))
        return fresh

    def close(self) -> None:
        if self._events is not None:
            self._supported(lambda: self.nvml.nvmlEventSetFree(self._events))
            self._events = None
        self._supported(self.nvml.nvmlShutdown)
