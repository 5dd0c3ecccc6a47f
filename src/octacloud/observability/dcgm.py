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


@dataclass(frozen=True, slots=True)
class CardIdentity:
    index: int
    uuid: str
    model: str
    pci_bus_id: str
    pcie_max_bytes_per_s: float | None
    """One direction's bandwidth of the card's current PCIe link (None when NVML cannot say)."""


@dataclass(slots=True)
class CardReading:
    """One card's fields at one moment (``values``: dcgm-exporter field name → value)."""

    card: CardIdentity
    values: dict[str, float] = field(default_factory=dict)

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
        GPU lost — one missing field must not cost the others)."""
        try:
            return call()
        except self.nvml.NVMLError:
            return None

    def read(self, now: float) -> list[CardReading]:
        """One reading per card; ``now`` (monotonic seconds) turns NVLink byte counters into rates."""
        self._drain_xid_events()
        return [self._read(card, h, now) for card, h in zip(self.cards, self.handles, strict=True)]

    def _read(self, card: CardIdentity, h: Any, now: float) -> CardReading:
        nvml, get = self.nvml, self._supported
        values: dict[str, float] = {}
        util = get(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            values[GPU_UTIL], values[MEM_COPY_UTIL] = float(util.gpu), float(util.memory)
        memory = get(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
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
        if self._events is not None and card.index in self._xid:
            values[XID] = float(self._xid[card.index])
        return CardReading(card, values)

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

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        nvml = self.nvml
        for _ in range(1024):  # bounded: a storm of events must not stall the sampler
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            except nvml.NVMLError as exc:
                log.warning("NVML event wait failed (%s): XID reporting stops", exc)
                self._events = None
                return
            index = self._supported(partial(nvml.nvmlDeviceGetIndex, event.device))
            if index is not None and int(index) in self._xid:
                self._xid[int(index)] = int(event.eventData)

    def close(self) -> None:
        if self._events is not None:
            self._supported(lambda: self.nvml.nvmlEventSetFree(self._events))
            self._events = None
        self._supported(self.nvml.nvmlShutdown)
