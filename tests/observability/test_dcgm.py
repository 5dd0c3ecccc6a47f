"""The NVML reader against a fake NVML: dcgm-exporter's names and units, unsupported fields, rates, XID events."""

from __future__ import annotations

import pytest

from octacloud.observability import dcgm
from octacloud.observability.dcgm import NvmlCards

from .fakes import FakeCard, FakeNvml


def test_reads_every_field_in_dcgm_exporter_units() -> None:
    nvml = FakeNvml([FakeCard()])
    reader = NvmlCards(nvml)
    (first,) = reader.read(now=10.0)
    assert first.card.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert first.card.model == "NVIDIA H100 80GB HBM3"
    assert first.card.pci_bus_id == "00000000:17:00.0"
    v = first.values
    assert v[dcgm.GPU_UTIL] == 37 and v[dcgm.MEM_COPY_UTIL] == 12  # percent
    assert v[dcgm.FB_USED] == 20 * 1024 and v[dcgm.FB_FREE] == 60 * 1024  # MiB
    assert v[dcgm.PCIE_TX] == 1000 * 1024 and v[dcgm.PCIE_RX] == 2000 * 1024  # bytes per second
    assert v[dcgm.POWER] == pytest.approx(312.5)  # watts from milliwatts
    assert v[dcgm.ENERGY] == 9_000_000  # millijoules, as DCGM
    assert v[dcgm.GPU_TEMP] == 61
    assert (v[dcgm.SM_CLOCK], v[dcgm.MEM_CLOCK]) == (1980, 2619)
    assert (v[dcgm.ECC_SBE], v[dcgm.ECC_DBE]) == (3, 0)
    assert v[dcgm.XID] == 0
    assert dcgm.NVLINK_TX not in v  # a rate needs two readings
    assert set(v) <= set(dcgm.FIELDS)


def test_nvlink_counters_become_rates_between_readings() -> None:
    card = FakeCard()
    reader = NvmlCards(FakeNvml([card]))
    reader.read(now=10.0)
    card.nvlink_kib = [4096, 1024]
    (r,) = reader.read(now=12.0)
    assert r.values[dcgm.NVLINK_TX] == pytest.approx(4096 * 1024 / 2)
    assert r.values[dcgm.NVLINK_RX] == pytest.approx(1024 * 1024 / 2)
    card.nvlink_kib = [0, 0]  # a counter that went back (driver reload) gives no rate rather than a negative one
    (r,) = reader.read(now=13.0)
    assert dcgm.NVLINK_TX not in r.values


def test_unsupported_fields_are_left_out_not_zero() -> None:
    card = FakeCard(ecc=None, nvlink=False)
    reader = NvmlCards(FakeNvml([card], events=False))
    reader.read(now=1.0)
    (r,) = reader.read(now=2.0)
    for missing in (dcgm.ECC_SBE, dcgm.ECC_DBE, dcgm.NVLINK_TX, dcgm.NVLINK_RX, dcgm.XID):
        assert missing not in r.values
    assert r.values[dcgm.GPU_UTIL] == 37


def test_xid_events_are_drained_without_waiting_and_the_last_one_is_reported() -> None:
    nvml = FakeNvml([FakeCard(), FakeCard(uuid="GPU-1")])
    reader = NvmlCards(nvml)
    nvml.xid(1, 48)
    nvml.xid(1, 79)
    a, b = reader.read(now=1.0)
    assert (a.values[dcgm.XID], b.values[dcgm.XID]) == (0, 79)
    assert not nvml.pending_events


def test_utilisation_terms_for_the_scheduler() -> None:
    (r,) = NvmlCards(FakeNvml([FakeCard(pcie_kib_s=(0, 31_507_812))])).read(now=1.0)
    terms = r.utilisation()
    assert terms["gpu_utilisation"] == pytest.approx(0.37)
    assert terms["gpu_memory_bandwidth"] == pytest.approx(0.12)
    # PCIe 5 × 16: 63 GB/s one way; 31.5 M KiB/s is about half of it
    assert terms["pcie_throughput"] == pytest.approx(31_507_812 * 1024 / (3938e6 * 16))


def test_close_shuts_nvml_down() -> None:
    nvml = FakeNvml([FakeCard()])
    NvmlCards(nvml).close()
    assert nvml.shutdown


def test_extended_fields_in_dcgm_units_and_absent_when_not_there() -> None:
    v = NvmlCards(FakeNvml([FakeCard()])).read(0.0)[0].values
    assert v[dcgm.FB_TOTAL] == 80 * 1024  # MiB
    assert v[dcgm.POWER_LIMIT] == 700.0  # mW -> W
    assert v[dcgm.POWER_VIOLATION] == 5000.0  # ns -> us
    assert v[dcgm.THERMAL_VIOLATION] == 0.0
    assert (v[dcgm.RETIRED_SBE], v[dcgm.RETIRED_DBE]) == (2.0, 1.0)
    assert (v[dcgm.REMAP_CORRECTABLE], v[dcgm.REMAP_UNCORRECTABLE], v[dcgm.REMAP_FAILURE]) == (4.0, 1.0, 0.0)
    assert dcgm.FAN_SPEED not in v  # NotSupported on this card
    assert dcgm.BAR1_USED not in v  # this NVML module has no such call: left out, nothing else lost
    assert set(v) <= set(dcgm.FIELDS)
