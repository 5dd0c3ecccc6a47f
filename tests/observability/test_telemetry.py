"""The sampler on a manual clock: CPU "cards" from replica measurements, NVML cards, the scheduler's snapshot."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from octacloud.core import Gpu, Node
from octacloud.core.clock import ManualClock
from octacloud.observability import dcgm
from octacloud.observability.dcgm import NvmlCards
from octacloud.observability.replicas import ProcessSample, ReplicaInfo, ReplicaServing, parse_statistics, read_process
from octacloud.observability.telemetry import (
    CPU_BUSY,
    CPU_CORES,
    CPU_MEMORY_FREE,
    CPU_MEMORY_USED,
    CardKey,
    TelemetrySampler,
)
from octacloud.scheduler.telemetry import TelemetrySource

from .fakes import FakeCard, FakeNvml

CPU_NODE = Node("cpu-a", 4000, 16384, (Gpu(0, "cpu", 1024), Gpu(1, "cpu", 1024)))
GPU_NODE = Node("gpu-a", 64000, 262144, (Gpu(0, "H100", 81920), Gpu(1, "H100", 81920)))
MIB = 1024 * 1024


class FakeScraper:
    def __init__(self) -> None:
        self.execution_ns: dict[str, int] = {}
        self.down: set[str] = set()

    async def scrape(self, replicas: Sequence[ReplicaInfo]) -> dict[str, ReplicaServing]:
        return {
            r.id: ReplicaServing(execution_ns=self.execution_ns.get(r.id, 0), batch_executions={1: 3})
            for r in replicas
            if r.ready and r.id not in self.down
        }

    async def close(self) -> None:
        pass


class FakeProcesses:
    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.rss: dict[int, int] = {}

    def __call__(self, pid: int) -> ProcessSample | None:
        if pid not in self.cpu:
            return None
        return ProcessSample(self.cpu[pid], self.rss[pid])


def replica(rid: str, node: str, gpus: tuple[int, ...], pid: int | None, state: str = "ready") -> ReplicaInfo:
    return ReplicaInfo(rid, rid.split("-")[0], "acme", state, 2, node, gpus, 250, pid, http_port=1, metrics_port=2)


Setup = tuple[ManualClock, FakeScraper, FakeProcesses, list[ReplicaInfo], TelemetrySampler]


@pytest.fixture
def setup() -> Setup:
    clock = ManualClock()
    scraper, procs = FakeScraper(), FakeProcesses()
    replicas = [replica("a-1", "cpu-a", (0,), 101), replica("b-1", "cpu-a", (0,), 102)]
    sampler = TelemetrySampler(
        lambda: [CPU_NODE], lambda: replicas, clock, scraper=scraper, processes=procs, interval_s=1.0
    )
    return clock, scraper, procs, replicas, sampler


async def test_cpu_cards_report_replica_measured_equivalents(setup: Setup) -> None:
    clock, scraper, procs, _, sampler = setup
    procs.cpu.update({101: 10.0, 102: 5.0})
    procs.rss.update({101: 100 * MIB, 102: 50 * MIB})
    first = await sampler.sample()
    card0 = first.cards[CardKey("cpu-a", 0)]
    assert card0.source == "replicas"
    assert card0.replicas == ("a-1", "b-1") and card0.deployments == ("a", "b")
    assert CPU_BUSY not in card0.values  # rates need two samples
    assert card0.values[CPU_MEMORY_USED] == 150 * MIB
    assert card0.values[CPU_MEMORY_FREE] == (1024 - 150) * MIB
    # an empty card is measurably idle
    assert first.cards[CardKey("cpu-a", 1)].values[CPU_BUSY] == 0.0

    clock.advance(2.0)
    procs.cpu.update({101: 11.0, 102: 6.0})  # one CPU second each in two seconds
    scraper.execution_ns.update({"a-1": 500_000_000, "b-1": 300_000_000})  # 0.5 s and 0.3 s of batches
    await sampler.sample()
    clock.advance(2.0)
    procs.cpu.update({101: 12.0, 102: 7.0})
    scraper.execution_ns.update({"a-1": 1_500_000_000, "b-1": 700_000_000})
    third = await sampler.sample()
    card0 = third.cards[CardKey("cpu-a", 0)]
    assert card0.values[CPU_BUSY] == pytest.approx((1.0 + 0.4) / 2)
    # two cores per card (4 cores, 2 cards): 1 CPU s/s over 2 cores
    assert card0.values[CPU_CORES] == pytest.approx(0.5)
    assert third.replicas["a-1"].busy_ratio == pytest.approx(0.5)
    assert third.replicas["a-1"].cpu_cores == pytest.approx(0.5)
    assert not [k for k in card0.values if k.startswith("DCGM_")]


async def test_scheduler_snapshot_is_fresh_or_empty(setup: Setup) -> None:
    clock, scraper, procs, _, sampler = setup
    assert isinstance(sampler, TelemetrySource)
    assert sampler.snapshot() == {}
    procs.cpu.update({101: 1.0, 102: 1.0})
    procs.rss.update({101: 1, 102: 1})
    await sampler.sample()
    clock.advance(1.0)
    scraper.execution_ns.update({"a-1": 800_000_000, "b-1": 800_000_000})
    await sampler.sample()
    clock.advance(1.0)
    scraper.execution_ns.update({"a-1": 1_600_000_000, "b-1": 1_600_000_000})
    await sampler.sample()
    snap = sampler.snapshot()
    # card 0 is busy beyond 1 (1.6 s of batches per second), capped at 1; card 1 idle: mean 0.5
    assert snap["cpu-a"]["gpu_utilisation"] == pytest.approx(0.5)
    clock.advance(3.5)  # older than 3 intervals: the scheduler must not score on it
    assert sampler.snapshot() == {}


async def test_a_slow_scrape_keeps_the_recent_measurement(setup: Setup) -> None:
    clock, scraper, _, _, sampler = setup
    await sampler.sample()
    clock.advance(1.0)
    scraper.execution_ns["a-1"] = 250_000_000
    await sampler.sample()
    scraper.down.add("a-1")
    clock.advance(1.0)
    kept = await sampler.sample()
    assert kept.replicas["a-1"].busy_ratio == pytest.approx(0.25)
    assert kept.replicas["a-1"].serving is not None
    clock.advance(3.0)
    gone = await sampler.sample()
    assert gone.replicas["a-1"].busy_ratio is None and gone.replicas["a-1"].serving is None


async def test_a_restarted_replica_starts_its_rates_again(setup: Setup) -> None:
    clock, _, procs, replicas, sampler = setup
    procs.cpu.update({101: 100.0, 102: 0.0, 103: 0.5})
    procs.rss.update({101: 1, 102: 1, 103: 1})
    await sampler.sample()
    replicas[0] = replica("a-1", "cpu-a", (0,), 103)  # same replica, new process: CPU time began at 0
    clock.advance(1.0)
    after = await sampler.sample()
    assert after.replicas["a-1"].cpu_cores is None  # never a negative or a huge bogus rate


async def test_nvml_cards_carry_dcgm_fields_and_feed_the_scheduler() -> None:
    clock = ManualClock()
    nvml = FakeNvml([FakeCard(util=(80, 40)), FakeCard(uuid="GPU-1", util=(20, 10), temperature=75)])
    replicas = [replica("llm-1", "gpu-a", (1,), None)]
    sampler = TelemetrySampler(
        lambda: [GPU_NODE, CPU_NODE], lambda: replicas, clock, nvml=NvmlCards(nvml), nvml_node="gpu-a"
    )
    sample = await sampler.sample()
    card1 = sample.cards[CardKey("gpu-a", 1)]
    assert card1.source == "nvml" and card1.identity is not None and card1.identity.uuid == "GPU-1"
    assert card1.replicas == ("llm-1",)
    assert card1.values[dcgm.GPU_UTIL] == 20
    node = sampler.snapshot()["gpu-a"]
    assert node["gpu_utilisation"] == pytest.approx(0.5)
    assert node["gpu_memory_bandwidth"] == pytest.approx(0.25)
    assert node["temperature_c"] == 75
    assert node["power_draw_w"] == pytest.approx(625.0)
    assert node["ecc_errors"] == 6
    assert sample.cards[CardKey("cpu-a", 0)].source == "replicas"
    await sampler.close()
    assert nvml.shutdown


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        TelemetrySampler(lambda: [], lambda: [], ManualClock(), interval_s=0)


def test_read_process_of_this_process() -> None:
    import os

    me = read_process(os.getpid())
    assert me is not None and me.cpu_seconds > 0 and me.rss_bytes > 1024 * 1024
    assert read_process(2**22 + 12345) is None


def test_read_process_counts_the_processes_under_it() -> None:
    """A replica's compute processes are its children: their CPU and memory are the replica's."""
    import os
    import subprocess
    import sys

    script = "import time\nblock = bytearray(64 << 20)\nend = time.process_time() + 0.3\n"
    script += "while time.process_time() < end: pass\nprint('ready', flush=True)\ntime.sleep(30)\n"
    before = read_process(os.getpid())
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            alone = read_process(child.pid)
            both = read_process(os.getpid())
            assert before is not None and alone is not None and both is not None
            assert alone.rss_bytes > 64 << 20
            assert both.rss_bytes >= before.rss_bytes + alone.rss_bytes - (8 << 20)
            assert both.cpu_seconds >= before.cpu_seconds + 0.25
        finally:
            child.kill()
    after = read_process(os.getpid())  # reaped: its CPU stays counted, its memory does not
    assert after is not None and both is not None
    assert after.cpu_seconds >= both.cpu_seconds - 0.02 and after.rss_bytes < both.rss_bytes - (32 << 20)


def test_parse_statistics_sums_versions_and_batch_sizes() -> None:
    def d(count: int, ns: int) -> dict[str, int]:
        return {"count": count, "ns": ns}

    payload = {
        "model_stats": [
            {
                "inference_count": 7,
                "execution_count": 4,
                "batch_stats": [
                    {"batch_size": 1, "compute_input": d(1, 10), "compute_infer": d(1, 100), "compute_output": d(1, 5)},
                    {"batch_size": 2, "compute_input": d(3, 30), "compute_infer": d(3, 600), "compute_output": d(3, 9)},
                ],
            },
            {"inference_count": 2, "execution_count": 1, "batch_stats": [
                {"batch_size": 2, "compute_input": d(1, 1), "compute_infer": d(1, 50), "compute_output": d(1, 1)}]},
        ]
    }  # fmt: skip
    s = parse_statistics(payload)
    assert s.batch_executions == {1: 1, 2: 4}
    assert s.execution_ns == 10 + 100 + 5 + 30 + 600 + 9 + 1 + 50 + 1
    assert (s.inference_count, s.execution_count) == (9, 5)
