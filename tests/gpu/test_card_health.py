"""XID events, ECC counters and a lost GPU become card health (fake NVML): the verdicts the controller fails over."""

from __future__ import annotations

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
