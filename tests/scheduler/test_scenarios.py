"""Declared topologies with expected placements, policy by policy (table-driven, as KAI-Scheduler's tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from octacloud.core import Node, Request
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req

SHARE_600 = TargetWorkload((WorkloadShape(1000, 600, 1),), (1.0,))


@dataclass
class Scenario:
    name: str
    policy: str
    nodes: list[Node]
    request: Request
    expect: tuple[str, tuple[int, ...]] | None
    """(node, cards) or None for unschedulable."""
    before: list[tuple[Request, str, tuple[int, ...]]] = field(default_factory=list)
    workload: TargetWorkload | None = None
    rules: bool = False
    expect_milli: int | None = None


SCENARIOS = [
    Scenario(
        "packing prefers a shared card over an idle node",
        "packing",
        [node("a"), node("b")],
        req("p", 300),
        ("a", (0,)),
        before=[(req("x", 500), "a", (0,))],
    ),
    Scenario(
        "packing uses a free card of a used node before an idle node",
        "packing",
        [node("a"), node("b")],
        req("p", 1000),
        ("a", (1,)),
        before=[(req("x", 500), "a", (0,))],
    ),
    Scenario(
        "bestfit takes the node left fullest",
        "bestfit",
        [node("a", 4), node("b", 2)],
        req("p", 1000),
        ("b", (0,)),
    ),
    Scenario(
        "bestfit card choice is the fullest card that fits",
        "bestfit",
        [node("a", 3)],
        req("p", 200),
        ("a", (2,)),
        before=[(req("x", 500), "a", (1,)), (req("y", 700), "a", (2,))],
    ),
    Scenario(
        "clustering keeps shares with shares",
        "clustering",
        [node("a"), node("b")],
        req("p", 250),
        ("b", (1,)),
        before=[(req("whole", 1000), "a", (0,)), (req("share", 250), "b", (1,))],
    ),
    Scenario(
        "dotprod avoids aligning with a roomy node",
        "dotprod",
        [node("big", 8, cpu=96_000), node("small", 1, cpu=8_000)],
        req("p", 1000, cpu=4000),
        ("small", (0,)),
    ),
    Scenario(
        "fgd picks the card that leaves least unusable share",
        "fgd",
        [node("a"), node("b")],
        req("p", 400),
        ("a", (1,)),
        before=[(req("x", 500), "a", (1,))],
        workload=SHARE_600,
    ),
    Scenario(
        "whole cards are the first fully free ones",
        "fgd",
        [node("a", 4)],
        req("p", 1000, 2),
        ("a", (0, 2)),
        before=[(req("x", 400), "a", (1,))],
        workload=SHARE_600,
    ),
    Scenario(
        "a GPU model constraint is honoured",
        "bestfit",
        [node("p100", 1, model="P100"), node("t4", 4, model="T4")],
        req("p", 500, models=["T4"]),
        ("t4", (0,)),
    ),
    Scenario(
        "multi-card requests never span nodes",
        "fgd",
        [node("a", 2), node("b", 2)],
        req("p", 1000, 3),
        None,
        workload=SHARE_600,
    ),
    Scenario(
        "CPU is checked per node",
        "packing",
        [node("a", 2, cpu=2000), node("b", 2, cpu=64_000)],
        req("p", 500, cpu=4000),
        ("b", (0,)),
    ),
    Scenario(
        "the product rounds a share up to whole octants",
        "octacloud",
        [node("a", 1)],
        req("p", 470),
        ("a", (0,)),
        workload=SHARE_600,
        rules=True,
        expect_milli=500,
    ),
    Scenario(
        "the 80 % card-memory rule rejects a model that needs 90 % of every card",
        "octacloud",
        [node("a", 1, card_mib=10_000)],
        req("p", 500, gpu_mib=9_000),
        None,
        workload=SHARE_600,
        rules=True,
    ),
    Scenario(
        "spread takes the emptiest node",
        "spread",
        [node("a"), node("b")],
        req("p", 500),
        ("b", (0,)),
        before=[(req("x", 250), "a", (0,))],
    ),
    Scenario(
        "NVLink: two cards from one linked pair",
        "octacloud",
        [node("a", 4, nvlink=[0, 0, 1, 1])],
        req("p", 1000, 2),
        ("a", (2, 3)),
        before=[(req("x", 1000), "a", (0,))],
        workload=SHARE_600,
        rules=True,
    ),
]


@pytest.mark.parametrize("case", SCENARIOS, ids=lambda c: c.name)
def test_scenario(case: Scenario) -> None:
    state = ClusterState(case.nodes)
    for r, where, cards in case.before:
        place(state, r, where, cards)
    scheduler = Scheduler(state, build_profile(case.policy, seed=7, workload=case.workload, rules=case.rules))
    decision = scheduler.schedule(case.request)
    check_invariants(state)
    if case.expect is None:
        assert decision.placement is None, decision.explain()
        assert decision.reasons
        assert case.request.name not in state.allocations
        return
    assert decision.placement is not None, decision.explain()
    assert (decision.placement.node, decision.placement.gpus) == case.expect
    if case.expect_milli is not None:
        assert decision.placement.milli_per_gpu == case.expect_milli
        assert state.allocations[case.request.name].request.gpu_milli == case.expect_milli


def test_random_places_on_random_feasible_nodes_and_cards() -> None:
    state = ClusterState([node(f"n{i}", 2) for i in range(6)])
    scheduler = Scheduler(state, build_profile("random", seed=3))
    nodes = {scheduler.schedule(req(f"r{k}", 100)).placement.node for k in range(12)}  # type: ignore[union-attr]
    check_invariants(state)
    assert len(nodes) > 2


def test_ties_follow_one_node_order_per_seed() -> None:
    def first_choice(seed: int) -> str:
        state = ClusterState([node(f"n{i}", 2) for i in range(16)])
        decision = Scheduler(state, build_profile("bestfit", seed=seed)).schedule(req("p", 1000))
        assert decision.placement is not None
        return decision.placement.node

    assert first_choice(1) == first_choice(1)
    assert len({first_choice(s) for s in range(8)}) > 1


@pytest.mark.parametrize("policy", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "spread"])
def test_invariants_hold_after_every_decision(policy: str) -> None:
    nodes = [node(f"n{i}", c, cpu=16_000) for i, c in enumerate([1, 2, 4, 8, 2, 4])]
    shapes: list[Callable[[int], Request]] = [
        lambda k: req(f"s{k}", 150 + (k * 37) % 700, cpu=1500),
        lambda k: req(f"w{k}", 1000, 1 + k % 3, cpu=2500),
        lambda k: req(f"c{k}", cpu=3000),
    ]
    workload = TargetWorkload.from_requests([shapes[k % 3](k) for k in range(30)])
    state = ClusterState(nodes)
    scheduler = Scheduler(state, build_profile(policy, seed=11, workload=workload))
    for k in range(80):
        scheduler.schedule(shapes[k % 3](k))
        check_invariants(state)
    assert state.allocated_gpu_milli > 0
