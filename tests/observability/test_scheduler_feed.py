"""The sampler is the scheduler's telemetry source: utilisation-aware scoring sees what the replicas measured."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from octacloud.core import Gpu, Node, Request
from octacloud.core.clock import ManualClock
from octacloud.observability.replicas import ReplicaInfo, ReplicaServing
from octacloud.observability.telemetry import TelemetrySampler
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.policies import build_profile

PROFILE = """name: utilisation
plugins:
  - resource-fit
  - plugin: telemetry
    name: gpu-utilisation
    args: {metric: gpu_utilisation, prefer: low}
"""
NODES = [Node(n, 4000, 16384, (Gpu(0, "cpu", 1024),)) for n in ("node-a", "node-b")]


class Scraper:
    def __init__(self) -> None:
        self.busy_ns = {"a-1": 0, "b-1": 0}

    async def scrape(self, replicas: Sequence[ReplicaInfo]) -> dict[str, ReplicaServing]:
        return {r.id: ReplicaServing(execution_ns=self.busy_ns[r.id]) for r in replicas}

    async def close(self) -> None:
        pass


async def test_placement_avoids_the_busy_node(tmp_path: Path) -> None:
    clock, scraper = ManualClock(), Scraper()
    replicas = [
        ReplicaInfo("a-1", "a", "acme", "ready", 1, "node-a", (0,), 125, None, http_port=1),
        ReplicaInfo("b-1", "b", "acme", "ready", 1, "node-b", (0,), 125, None, http_port=1),
    ]
    sampler = TelemetrySampler(lambda: NODES, lambda: replicas, clock, scraper=scraper)
    (tmp_path / "utilisation.yaml").write_text(PROFILE)
    profile = build_profile(str(tmp_path / "utilisation.yaml"), seed=0, telemetry=sampler)
    scheduler = Scheduler(ClusterState(NODES), profile)

    async def measure(busy_a: float, busy_b: float) -> None:
        await sampler.sample()
        clock.advance(1.0)
        scraper.busy_ns["a-1"] += int(busy_a * 1e9)
        scraper.busy_ns["b-1"] += int(busy_b * 1e9)
        await sampler.sample()

    await measure(0.9, 0.1)
    assert sampler.snapshot()["node-a"]["gpu_utilisation"] > sampler.snapshot()["node-b"]["gpu_utilisation"]
    first = scheduler.schedule(Request("r-1", 1, 250))
    assert first.placement is not None and first.placement.node == "node-b"

    await measure(0.05, 0.95)  # the load moved: the next decision follows it
    second = scheduler.schedule(Request("r-2", 1, 250))
    assert second.placement is not None and second.placement.node == "node-a"
