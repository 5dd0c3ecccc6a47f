"""GPU time actually used: NVML's per-process samples, attributed to replicas by PID, billed by the ledger next
to the slice each replica holds (fake NVML, manual clock, a real SQLite ledger)."""

from __future__ import annotations

from pathlib import Path

from octacloud.core import Gpu, Node
from octacloud.core.clock import ManualClock
from octacloud.metering import Allocation, Ledger, Meter, Metric, summarize
from octacloud.observability.dcgm import NvmlCards
from octacloud.observability.replicas import ReplicaInfo
from octacloud.observability.telemetry import TelemetrySampler
from tests.metering.test_ledger import EPOCH, FakeSource, run_for
from tests.observability.fakes import FakeCard, FakeNvml

NODE = Node("gpu-a", 64_000, 512 * 1024, tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 81_559) for i in range(2)))


def _replicas() -> list[ReplicaInfo]:
    return [
        ReplicaInfo("web-aaaaaa", "web", "acme", "ready", 4, "gpu-a", (0,), 500, pid=1001),
        ReplicaInfo("api-bbbbbb", "api", "globex", "ready", 2, "gpu-a", (0,), 250, pid=1002),
        ReplicaInfo("big-cccccc", "big", "acme", "ready", 16, "gpu-a", (0, 1), 1000, pid=1003),
    ]


async def test_process_samples_are_attributed_to_replicas_by_pid() -> None:
    card0 = FakeCard(processes={1001: (30, 4 << 30), 1002: (10, 1 << 30), 1003: (40, 8 << 30), 999: (5, 1 << 20)})
    card1 = FakeCard(processes={1003: (60, 8 << 30)})
    clock = ManualClock(epoch=EPOCH)
    sampler = TelemetrySampler(
        lambda: [NODE], _replicas, clock, nvml=NvmlCards(FakeNvml([card0, card1])), nvml_node="gpu-a"
    )
    sample = await sampler.sample()
    assert sample.replicas["web-aaaaaa"].gpu_busy == 0.30
    assert sample.replicas["api-bbbbbb"].gpu_memory_bytes == 1 << 30
    big = sample.replicas["big-cccccc"]
    assert big.gpu_busy == 1.0  # 40 % of card 0 + 60 % of card 1
    assert big.gpu_memory_bytes == 16 << 30
    assert sampler.gpu_use() == {"web-aaaaaa": 300, "api-bbbbbb": 100, "big-cccccc": 1000}  # pid 999 is no replica
    # no newer NVML sample: no claim of use (rather than repeating the old one)
    clock.advance(1)
    assert (await sampler.sample()).replicas["web-aaaaaa"].gpu_busy is None
    clock.advance(10)
    assert sampler.gpu_use() == {}  # stale: the ledger bills nothing from old numbers


async def test_the_ledger_bills_gpu_used_next_to_the_slice_held(tmp_path: Path) -> None:
    ledger = Ledger.at(f"sqlite:///{tmp_path / 'ledger.db'}")
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource(
        [Allocation("acme", "web", "web-aaaaaa", "H100", 500), Allocation("globex", "api", "api-bbbbbb", "H100", 250)],
        used={"web-aaaaaa": 300, "api-bbbbbb": 400},  # a replica above its slice (MPS off) is billed its slice
    )
    meter = Meter(ledger, source, clock, interval_s=10)
    await run_for(meter, clock, 20)
    used = {r.tenant: 0 for r in ledger.records()}
    for r in ledger.records():
        if r.metric is Metric.GPU_USED:
            used[r.tenant] += r.quantity
    assert used == {"acme": 300 * 20_000, "globex": 250 * 20_000}
    lines = {line.tenant: line.as_dict() for line in summarize(ledger.records(), by="tenant")}
    assert lines["acme"]["octant_seconds"] == 80.0  # 4 octants held for 20 s
    assert lines["acme"]["gpu_used_octant_seconds"] == 48.0  # 0.3 of a card used for 20 s


async def test_the_cards_nvml_draw_is_the_ledgers_energy(tmp_path: Path) -> None:
    cards = [FakeCard(power_mw=400_000), FakeCard(power_mw=212_500)]
    clock = ManualClock(epoch=EPOCH)
    sampler = TelemetrySampler(lambda: [NODE], _replicas, clock, nvml=NvmlCards(FakeNvml(cards)), nvml_node="gpu-a")
    await sampler.sample()
    assert sampler.card_power() == {("gpu-a", 0): 400.0, ("gpu-a", 1): 212.5}
    ledger = Ledger.at(f"sqlite:///{tmp_path / 'ledger.db'}")
    slices = [
        Allocation("acme", "web", "web-aaaaaa", "H100", 500, "gpu-a", (0,)),
        Allocation("globex", "api", "api-bbbbbb", "H100", 250, "gpu-a", (0,)),
    ]
    meter = Meter(ledger, FakeSource(slices, power=sampler.card_power()), clock, interval_s=10)
    await run_for(meter, clock, 10)
    lines = {line.tenant: line.as_dict() for line in summarize(ledger.records(), by="tenant")}
    assert lines["acme"]["energy_wh"] == round(400 * 0.5 * 10 / 3600, 6)  # half the card's 400 W for 10 s
    assert lines["globex"]["energy_wh"] == round(400 * 0.25 * 10 / 3600, 6)
    assert sampler.card_power() == {}  # 10 s without a sample: stale, the ledger charges nothing from it
    ledger.close()
