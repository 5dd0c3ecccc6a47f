"""The design's rules: octant unit, the 80 % card-memory rule and the failover headroom."""

from __future__ import annotations

import pytest

from octacloud.core.units import round_up_to_octant
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, check_model_memory_rule, node, req

WORKLOAD = TargetWorkload((WorkloadShape(1000, 500, 1),), (1.0,))


def _scheduler(nodes: int = 5, cards: int = 2, card_mib: int = 16_384) -> Scheduler:
    state = ClusterState([node(f"n{i}", cards, card_mib=card_mib) for i in range(nodes)])
    return Scheduler(state, build_profile("octacloud", seed=0, workload=WORKLOAD, rules=True))


@pytest.mark.parametrize(("milli", "expected"), [(1, 125), (125, 125), (126, 250), (470, 500), (999, 1000)])
def test_octant_rounding(milli: int, expected: int) -> None:
    scheduler = _scheduler()
    decision = scheduler.schedule(req("p", milli))
    assert decision.placement is not None and decision.placement.milli_per_gpu == expected == round_up_to_octant(milli)
    assert scheduler.state.allocated_gpu_milli == expected


def test_raw_milli_mode_keeps_trace_values() -> None:
    state = ClusterState([node("a")])
    decision = Scheduler(state, build_profile("octacloud", seed=0, workload=WORKLOAD)).schedule(req("p", 470))
    assert decision.placement is not None and decision.placement.milli_per_gpu == 470


def test_model_memory_rule() -> None:
    scheduler = _scheduler(card_mib=10_000)
    assert scheduler.schedule(req("ok", 500, gpu_mib=8_000)).placed  # exactly 80 %
    refused = scheduler.schedule(req("big", 500, gpu_mib=8_001))
    assert not refused.placed
    assert "at most 80 % of a card" in refused.explain()
    check_model_memory_rule(scheduler.state)


def test_headroom_keeps_twenty_percent_for_failover_and_high_priority() -> None:
    scheduler = _scheduler(nodes=5, cards=2)  # 10 cards; normal work may hold 8
    placed = [scheduler.schedule(req(f"w{k}", 1000)).placed for k in range(10)]
    assert placed == [True] * 8 + [False] * 2
    refused = scheduler.schedule(req("more", 125))
    assert "failover reserve" in refused.explain()
    check_invariants(scheduler.state, headroom_percent=20)
    assert scheduler.schedule(req("failover", 1000, failover=True)).placed
    assert scheduler.schedule(req("vip", 1000, priority=100)).placed
    check_invariants(scheduler.state)
    assert scheduler.state.allocated_gpu_milli == 10_000


def test_cpu_only_work_is_not_held_back_by_the_gpu_reserve() -> None:
    scheduler = _scheduler(nodes=1, cards=1)
    assert scheduler.schedule(req("w", 1000, failover=True)).placed
    assert scheduler.schedule(req("cpu", cpu=2000)).placed
