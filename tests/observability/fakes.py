"""A fake NVML module: the parts of nvidia-ml-py's API the telemetry reader calls, with scriptable values.

Errors follow pynvml's shapes: ``NVMLError`` with subclasses per return code (``NVMLError_NotSupported``,
``NVMLError_Timeout``); field values come back as objects with ``nvmlReturn`` and ``value.ullVal``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


@dataclass
class FakeCard:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:17:00.0"
    util: tuple[int, int] = (37, 12)
    used_bytes: int = 20 * 1024**3
    free_bytes: int = 60 * 1024**3
    pcie_kib_s: tuple[int, int] = (1000, 2000)  # TX, RX
    nvlink_kib: list[int] = field(default_factory=lambda: [0, 0])  # cumulative TX, RX
    power_mw: int = 312_500
    energy_mj: int = 9_000_000
    temperature: int = 61
    clocks: tuple[int, int] = (1980, 2619)  # SM, memory
    ecc: tuple[int, int] | None = (3, 0)  # corrected, uncorrected; None: not supported
    pcie_link: tuple[int, int] = (5, 16)
    nvlink: bool = True
    power_limit_mw: int = 700_000
    violations_ns: tuple[int, int] = (5_000_000, 0)  # power, thermal
    retired: tuple[int, int] = (2, 1)  # single-bit, double-bit
    remapped: tuple[int, int, int, int] = (4, 1, 0, 0)  # correctable, uncorrectable, pending, failure
    processes: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (SM %, memory bytes)
    sample_us: int = 1_000_000  # the timestamp of the newest process-utilisation sample


class FakeNvml:
    """Module-like object: ``nvml.nvmlDeviceGet...(handle, ...)`` over a list of :class:`FakeCard`."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Timeout = NVMLError_Timeout
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_CLOCK_VIDEO = 3
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_PERF_POLICY_POWER = 0
    NVML_PERF_POLICY_THERMAL = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, cards: list[FakeCard], events: bool = True) -> None:
        self.cards = cards
        self.events_supported = events
        self.pending_events: deque[SimpleNamespace] = deque()
        self.shutdown = False

    # identity
    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.cards[h].uuid

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.cards[h].name.encode()  # older pynvml returns bytes

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.cards[h].bus_id.encode())

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self.cards[h].pcie_link[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self.cards[h].pcie_link[1]

    # readings
    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        gpu, memory = self.cards[h].util
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        c = self.cards[h]
        return SimpleNamespace(used=c.used_bytes, free=c.free_bytes, total=c.used_bytes + c.free_bytes)

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        return self.cards[h].pcie_kib_s[counter]

    def nvmlDeviceGetFieldValues(self, h: int, fields: list[tuple[int, int]]) -> list[Any]:
        c = self.cards[h]
        if not c.nvlink:
            raise NVMLError_NotSupported()
        out = []
        for field_id, scope in fields:
            assert scope == 0xFFFFFFFF, "NVLink counters must be summed over all links"
            k = field_id - self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            out.append(SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=c.nvlink_kib[k])))
        return out

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self.cards[h].power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self.cards[h].energy_mj

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.cards[h].temperature

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        if clock > len(self.cards[h].clocks):
            raise NVMLError_NotSupported()  # the video clock, on this card
        return self.cards[h].clocks[clock - 1]

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        ecc = self.cards[h].ecc
        if ecc is None:
            raise NVMLError_NotSupported()
        return ecc[kind]

    # the extended fields (a subset: the reader must leave out what a card or nvidia-ml-py lacks)
    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self.cards[h].power_limit_mw

    def nvmlDeviceGetViolationStatus(self, h: int, policy: int) -> Any:
        if policy >= len(self.cards[h].violations_ns):
            raise NVMLError_NotSupported()
        return SimpleNamespace(referenceTime=0, violationTime=self.cards[h].violations_ns[policy])

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        return [0x1000 * i for i in range(self.cards[h].retired[cause])]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self.cards[h].remapped

    def nvmlDeviceGetFanSpeed(self, h: int) -> int:
        raise NVMLError_NotSupported()  # passively cooled, as data-centre cards are

    # per-process accounting
    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, (_, mem) in self.cards[h].processes.items()]

    def nvmlDeviceGetProcessUtilization(self, h: int, last_seen_us: int) -> list[Any]:
        c = self.cards[h]
        if c.sample_us <= last_seen_us:
            raise self.NVMLError("Not Found")  # NVML's answer when no sample is newer than the one given
        return [
            SimpleNamespace(pid=pid, timeStamp=c.sample_us, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
            for pid, (sm, _) in c.processes.items()
        ]

    # XID events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        if not self.events_supported:
            raise NVMLError_NotSupported()

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0, "the sampler must never wait for events"
        if not self.pending_events:
            raise NVMLError_Timeout()
        return self.pending_events.popleft()

    def xid(self, card: int, xid: int) -> None:
        self.pending_events.append(SimpleNamespace(device=card, eventData=xid, eventType=8))

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True
