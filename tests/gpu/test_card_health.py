"""XID events, ECC counters and a lost GPU become card health (fake NVML): the verdicts the controller fails over."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core.model import Health
from octacloud.observability.card_health import CardHealthWatch
from octacloud.observability.dcgm import NvmlCards
from tests.observability.fakes import FakeCard, FakeNvml, NVMLError


class NVMLError_GpuIsLost(NVMLError):  # pynvml's own name
    pass


class _LosableNvml(FakeNvml):
    lost: set[int]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        if h in self.lost:
            raise NVMLError_GpuIsLost()
        return super().nvmlDeviceGetMemoryInfo(h)


def _watch(cards: int = 2) -> tuple[_LosableNvml, NvmlCards, CardHealthWatch]:
    nvml = _LosableNvml([FakeCard(uuid=f"GPU-{i}") for i in range(cards)])
    nvml.lost = set()
    return nvml, NvmlCards(nvml), CardHealthWatch("gpu-a")


@pytest.mark.parametrize(
    ("xid", "health"),
    [(79, Health.FAILED), (48, Health.FAILED), (95, Health.FAILED), (94, Health.DEGRADED), (63, Health.DEGRADED)],
)
def test_card_faults_from_xid_events(xid: int, health: Health) -> None:
    nvml, cards, watch = _watch()
    assert watch.observe(cards.read(0.0)) == []
    nvml.xid(1, xid)
    [verdict] = watch.observe(cards.read(1.0))
    assert (verdict.node, verdict.gpu, verdict.health) == ("gpu-a", 1, health)
    assert f"XID {xid}" in verdict.reason
    assert watch.observe(cards.read(2.0)) == []  # reported once


def test_application_xids_say_nothing_about_the_card() -> None:
    nvml, cards, watch = _watch()
    for xid in (13, 31, 43, 45):
        nvml.xid(0, xid)
    assert watch.observe(cards.read(0.0)) == []


def test_rising_double_bit_ecc_fails_the_card_but_an_old_count_does_not() -> None:
    nvml, cards, watch = _watch()
    nvml.cards[0].ecc = (3, 2)  # two DBEs from before the cloud started: already retired, not news
    assert watch.observe(cards.read(0.0)) == []
    nvml.cards[0].ecc = (3, 3)
    [verdict] = watch.observe(cards.read(1.0))
    assert verdict.health is Health.FAILED and "1 new double-bit" in verdict.reason


def test_a_lost_gpu_fails_and_health_never_improves_by_itself() -> None:
    nvml, cards, watch = _watch()
    nvml.xid(0, 94)
    assert [v.health for v in watch.observe(cards.read(0.0))] == [Health.DEGRADED]
    nvml.lost.add(0)
    [verdict] = watch.observe(cards.read(1.0))
    assert verdict.health is Health.FAILED and "lost" in verdict.reason
    nvml.lost.clear()
    assert watch.observe(cards.read(2.0)) == []
    assert watch.health[0] is Health.FAILED


async def test_a_failed_card_fails_its_replicas_over_and_a_degraded_one_takes_no_new_work(tmp_path: Path) -> None:
    """The controller's side (manual clock, fake launcher and prober): the card's replicas are re-placed on the
    node's other card; a degraded card keeps what it has."""
    from octacloud.control.deployments import ReplicaState
    from octacloud.core import Gpu, Node
    from tests.cluster.controller_fakes import Harness

    node = Node("gpu-a", 64_000, 512 * 1024, tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 81_559) for i in range(2)))
    h = Harness(tmp_path, nodes=[node])
    h.deploy("a", octants=4)
    await h.reconcile()
    await h.health()
    (r,) = h.replicas("a")
    card = r.gpus[0]
    h.controller.mark_card("gpu-a", card, Health.FAILED, "XID 79: GPU has fallen off the bus")
    await h.settle()
    lost = h.replicas("a")[0]
    assert lost.state is ReplicaState.PENDING and lost.failover and h.routed("a") == []
    await h.reconcile()
    moved = h.replicas("a")[0]
    assert moved.state is ReplicaState.STARTING and moved.gpus == (1 - card,)
    other = 1 - card
    h.controller.mark_card("gpu-a", other, Health.DEGRADED, "XID 94: contained ECC error")
    await h.settle()
    assert h.replicas("a")[0].gpus == (other,) and h.replicas("a")[0].state is not ReplicaState.PENDING
    h.deploy("b", octants=2)
    await h.reconcile()
    assert h.replicas("b")[0].state is ReplicaState.PENDING  # no healthy card left for new work
    assert any("card" in str(e["message"]) and "failed" in str(e["message"]) for e in h.store.events())


async def test_a_dead_mps_server_restarts_the_nodes_gpu_replicas(tmp_path: Path) -> None:
    from octacloud.control.deployments import ReplicaState
    from octacloud.core import Gpu, Node
    from tests.cluster.controller_fakes import Harness

    node = Node("gpu-a", 64_000, 512 * 1024, tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 81_559) for i in range(2)))
    h = Harness(tmp_path, nodes=[node])
    h.deploy("a", octants=2, replicas=2)
    await h.reconcile()
    await h.health()
    before = {r.id: r.handle for r in h.replicas("a")}
    h.controller.restart_gpu_replicas("gpu-a", "the node's MPS server exited")
    await h.settle()
    assert all(r.state is ReplicaState.FAILED for r in h.replicas("a"))
    h.clock.advance(5)
    await h.health()
    await h.reconcile()
    after = {r.id: r.handle for r in h.replicas("a")}
    assert set(after) == set(before) and all(
        after[k] and after[k] != before[k] for k in after
    )  # same slices, new processes


async def test_the_telemetry_sampler_hands_every_reading_to_the_watch() -> None:
    """What ``octacloud up`` wires: each sample's NVML readings reach the card-health watch, and a handler that
    fails never costs the sample."""
    from octacloud.core import Gpu, Node
    from octacloud.core.clock import ManualClock
    from octacloud.observability.card_health import CardVerdict
    from octacloud.observability.telemetry import TelemetrySampler

    nvml, cards, watch = _watch()
    node = Node("gpu-a", 64_000, 512 * 1024, tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 81_559) for i in range(2)))
    seen: list[CardVerdict] = []
    sampler = TelemetrySampler(lambda: [node], list, ManualClock(), nvml=cards, nvml_node="gpu-a",
                               on_readings=lambda readings: seen.extend(watch.observe(readings)))  # fmt: skip
    nvml.xid(0, 48)
    await sampler.sample()
    assert [(v.gpu, v.health) for v in seen] == [(0, Health.FAILED)]
    sampler.on_readings = lambda readings: 1 / 0
    assert (await sampler.sample()).cards  # the sample is still taken
