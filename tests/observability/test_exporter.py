"""The cloud's /metrics text: it parses with the official parser, carries the right values and labels, and every
name and label in it is documented in docs/monitoring.md."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from octacloud.core import Gpu, Node, Placement, Request
from octacloud.core.clock import ManualClock
from octacloud.observability.dcgm import NvmlCards
from octacloud.observability.exporter import CloudCollector, cloud_registry
from octacloud.observability.monitor import CloudMonitor
from octacloud.observability.replicas import ReplicaInfo, ReplicaServing
from octacloud.observability.scheduling import Outcome, SchedulingStats
from octacloud.observability.telemetry import TelemetrySampler
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework.state import ClusterState

from .fakes import FakeCard, FakeNvml

DOC = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"
GPU = Node("gpu-a", 64000, 262144, (Gpu(0, "H100", 81920), Gpu(1, "H100", 81920)))
CPU = Node("cpu-a", 4000, 16384, (Gpu(0, "cpu", 1024),))
TRITON = """# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success untyped
nv_inference_request_success{model="chat",version="1"} 42.0
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="chat",version="1"} 2.0
"""


@dataclass
class Counters:
    requests: int = 0
    failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    latency_us_total: int = 0
    outstanding: int = 0


class Scraper:
    async def scrape(self, replicas: Sequence[ReplicaInfo]) -> dict[str, ReplicaServing]:
        families = list(text_string_to_metric_families(TRITON))
        return {r.id: ReplicaServing(families, {1: 5, 4: 2}, 1000, 13, 7) for r in replicas if r.ready}

    async def close(self) -> None:
        pass


def replicas() -> list[ReplicaInfo]:
    return [
        ReplicaInfo("chat-1", "chat", "acme", "ready", 3, "gpu-a", (0,), 375, None, http_port=1, metrics_port=2),
        ReplicaInfo("chat-2", "chat", "acme", "pending", 3),
        ReplicaInfo("big-1", "big", "globex", "pending", 16),
    ]


@pytest.fixture
async def collector() -> CloudCollector:
    clock = ManualClock()
    state = ClusterState([GPU, CPU])
    state.allocate(Request("chat-1", 1, 375, owner="acme"), Placement("chat-1", "gpu-a", (0,), 375))
    sampler = TelemetrySampler(
        lambda: state.nodes,
        replicas,
        clock,
        nvml=NvmlCards(FakeNvml([FakeCard(), FakeCard(uuid="GPU-1")])),
        nvml_node="gpu-a",
        scraper=Scraper(),
    )
    counters = {"chat": Counters(requests=10, failures=1, bytes_in=640, bytes_out=320, latency_us_total=2_500_000)}
    workload = TargetWorkload.from_requests([Request("w", 1, 125), Request("w", 1, 500), Request("w", 1, 750)])
    monitor = CloudMonitor(lambda: state, workload, sampler, lambda: counters, clock)
    await monitor.tick()
    stats = SchedulingStats()
    stats.decision(Outcome.PLACED, 0.0004)
    stats.decision(Outcome.UNSCHEDULABLE, 0.003)
    stats.preempted(2)

    def metering() -> Iterator[Metric]:
        family = CounterMetricFamily("octacloud_metering_requests", "Requests.", labels=["tenant"])
        family.add_metric(["acme"], 10.0)
        yield family

    return CloudCollector(monitor, stats, metering)


def scrape(collector: CloudCollector) -> dict[str, Metric]:
    text = generate_latest(cloud_registry(collector)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(family: Metric, suffix: str = "") -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == family.name + suffix}


async def test_gpu_telemetry_has_dcgm_names_and_labels(collector: CloudCollector) -> None:
    families = scrape(collector)
    util = families["DCGM_FI_DEV_GPU_UTIL"].samples
    assert len(util) == 2
    card0 = next(s for s in util if s.labels["gpu"] == "0")
    assert card0.value == 37
    assert card0.labels == {
        "gpu": "0", "UUID": "GPU-00000000-0000-0000-0000-000000000000", "device": "nvidia0",
        "modelName": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:17:00.0", "Hostname": "gpu-a",
        "node": "gpu-a", "replicas": "chat-1", "deployments": "chat",
    }  # fmt: skip
    # the CPU card of the other node reports replica-measured values under octacloud's names, never DCGM's
    assert {s.labels["node"] for s in families["octacloud_cpu_card_memory_used_bytes"].samples} == {"cpu-a"}
    assert all(s.labels["node"] == "gpu-a" for s in families["DCGM_FI_DEV_FB_USED"].samples)


async def test_scheduler_gateway_and_serving_values(collector: CloudCollector) -> None:
    f = scrape(collector)
    assert f["octacloud_scheduler_allocated_milli"].samples[0].value == 375
    assert f["octacloud_scheduler_capacity_milli"].samples[0].value == 3000
    assert f["octacloud_scheduler_allocation_ratio"].samples[0].value == pytest.approx(0.125)
    # card 0 of gpu-a has 625 free: too little for the 750 shape (one in three), so it is fragment for that shape
    assert f["octacloud_scheduler_fragmentation_milli"].samples[0].value == pytest.approx(625 / 3)
    assert values(f["octacloud_node_fragmentation_milli"])[(("node", "gpu-a"),)] == pytest.approx(625 / 3)
    held = values(f["octacloud_card_replica_milli"])
    key = (("deployment", "chat"), ("gpu", "0"), ("node", "gpu-a"), ("replica", "chat-1"), ("tenant", "acme"))
    assert held == {key: 375.0}
    pending = values(f["octacloud_scheduler_pending_replicas"])
    assert pending == {(("gpus", "1"), ("octants", "3")): 1.0, (("gpus", "2"), ("octants", "16")): 1.0}
    decisions = values(f["octacloud_scheduler_decisions"], "_total")
    assert decisions[(("outcome", "placed"),)] == 1 and decisions[(("outcome", "unschedulable"),)] == 1
    buckets = values(f["octacloud_scheduler_decision_duration_seconds"], "_bucket")
    assert buckets[(("le", "0.0005"),)] == 1 and buckets[(("le", "+Inf"),)] == 2
    assert values(f["octacloud_scheduler_preemptions"], "_total") == {(): 2.0}
    assert values(f["octacloud_gateway_requests"], "_total") == {(("deployment", "chat"),): 10.0}
    assert values(f["octacloud_gateway_request_duration_seconds"], "_total") == {(("deployment", "chat"),): 2.5}
    served = values(f["nv_inference_request_success"])
    assert served == {(("model", "chat"), ("node", "gpu-a"), ("replica", "chat-1"), ("version", "1")): 42.0}
    states = values(f["octacloud_replicas"])
    assert states[(("deployment", "chat"), ("state", "pending"))] == 1
    assert values(f["octacloud_metering_requests"], "_total") == {(("tenant", "acme"),): 10.0}


def documented() -> dict[str, set[str]]:
    """Metric name → labels, from the reference tables of docs/monitoring.md (``same`` repeats the row above)."""
    out: dict[str, set[str]] = {}
    previous: set[str] = set()
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([A-Za-z_:][A-Za-z0-9_:]*)` \|[^|]+\|\s*([^|]*?)\s*\|", line)
        if not m:
            continue
        raw = m.group(2).strip()
        labels = previous if raw == "same" else {x.strip() for x in raw.split(",") if x.strip()}
        out[m.group(1)] = previous = labels
    return out


async def test_every_exported_name_and_label_is_documented(collector: CloudCollector) -> None:
    docs = documented()
    assert len(docs) > 50
    for family in scrape(collector).values():
        for sample in family.samples:
            name = family.name if family.type == "histogram" else sample.name
            assert name in docs, f"{name} is exported but not documented in docs/monitoring.md"
            undocumented = set(sample.labels) - docs[name]
            assert not undocumented, f"{name}: labels {undocumented} are not documented"
