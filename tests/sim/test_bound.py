"""The LP lower bound: valid (never above what a placement achieves), tight on small cases, and its pieces."""

from __future__ import annotations

import itertools
import random

import pytest

from octacloud.core.model import Gpu, Node, Request
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.sim.bound import DFF_ORDERS, arrived_prefix, dff, packing_bound
from octacloud.sim.experiment import place


def _node(name: str, cards: int, cpu: int = 64_000, model: str = "T4") -> Node:
    return Node(name, cpu, 262_144, tuple(Gpu(g, model, 16_384) for g in range(cards)))


def _share(name: str, milli: int, cpu: int = 1000, models: frozenset[str] = frozenset()) -> Request:
    return Request(name, num_gpu=1, gpu_milli=milli, cpu_milli=cpu, memory_mib=1024, gpu_models=models)


def test_dual_feasible_functions_never_count_more_than_a_card() -> None:
    sizes = list(range(50, 1001, 10))
    rng = random.Random(1)
    for _ in range(3000):
        card: list[int] = []
        while True:
            s = rng.choice(sizes)
            if sum(card) + s > 1000:
                break
            card.append(s)
        for k in range(1, DFF_ORDERS + 1):
            assert sum(dff(k, s) for s in card) <= 1 + 1e-12, (k, card)
    assert dff(4, 810) == 1.0 and dff(4, 190) == 0.0 and dff(1, 500) == 0.5 and dff(3, 1000) == 1.0


def test_two_810_shares_cannot_share_a_card() -> None:
    # one card, two 810s: at most 810 of 1000 placed, whatever the relaxation does with fractions
    bound = packing_bound([_node("a", 1)], [_share("x", 810), _share("y", 810)])
    assert bound.unallocated_pct == pytest.approx(19.0)
    # 810 + 190 fill the card exactly
    assert packing_bound([_node("a", 1)], [_share("x", 810), _share("y", 190)]).unallocated_pct == pytest.approx(0.0)


def test_cpu_model_and_card_counts_bind() -> None:
    pods = [
        Request("p", num_gpu=1, gpu_milli=1000, cpu_milli=3000, gpu_models=frozenset({"T4"})),
        Request("q", num_gpu=1, gpu_milli=1000, cpu_milli=3000, gpu_models=frozenset({"T4"})),
        Request("big", num_gpu=4, gpu_milli=1000),  # fits no node: needs 4 cards on one node
    ]
    # both T4 pods fit 'a' (6 cores); neither may use the A10 node; the 4-card pod fits nowhere
    assert packing_bound([_node("a", 2, cpu=6000), _node("b", 2, model="A10")], pods).unallocated_pct == 50.0
    # with 4 cores on 'a' the relaxation places 4/3 of a 3-core pod: the bound is fractional but still binds
    bound = packing_bound([_node("a", 2, cpu=4000), _node("b", 2, model="A10")], pods)
    assert bound.unallocated_pct == pytest.approx(100 - 100 * (4000 / 3000) * 1000 / 4000, abs=1e-3)


def test_arrived_prefix_stops_below_the_limit() -> None:
    pods = [_share(f"p{i}", 500) for i in range(10)]
    assert len(arrived_prefix(pods, 2000)) == 4  # 2000 arrived would reach 100 % of 2000 < 100.5 %: 4 × 500 = 2000
    assert len(arrived_prefix(pods, 2000, limit=0.6)) == 2


def test_the_bound_is_below_every_policy_on_random_traces() -> None:
    rng = random.Random(7)
    fleet = [_node(f"n{i}", rng.choice((1, 2, 4)), cpu=rng.choice((8000, 16000))) for i in range(6)]
    capacity = sum(n.gpu_milli for n in fleet)
    for trial in range(6):
        pods = []
        for k in range(60):
            kind = rng.random()
            if kind < 0.5:
                pods.append(_share(f"s{k}", rng.choice((190, 320, 470, 650, 810)), cpu=rng.choice((1000, 4000))))
            elif kind < 0.9:
                pods.append(Request(f"w{k}", num_gpu=1, gpu_milli=1000, cpu_milli=rng.choice((2000, 6000))))
            else:
                pods.append(Request(f"m{k}", num_gpu=2, gpu_milli=1000, cpu_milli=4000))
        prefix = arrived_prefix(pods, capacity)
        bound = packing_bound(fleet, prefix).unallocated_pct
        workload = TargetWorkload.from_requests(pods)
        for policy in ("fgd", "octacloud", "bestfit"):
            state = place(fleet, prefix, policy=policy, seed=trial, workload=workload).state
            achieved = 100.0 - 100.0 * state.allocated_gpu_milli / capacity
            assert bound <= achieved + 1e-6, (trial, policy, bound, achieved)


def test_exhaustive_optimum_is_never_below_the_bound() -> None:
    # brute force the best subset placement of a few shares on two cards: the bound must not exceed it
    fleet = [_node("a", 1), _node("b", 1)]
    sizes = [650, 470, 320, 230, 810, 160]
    pods = [_share(f"p{i}", s) for i, s in enumerate(sizes)]
    best = 0
    for assignment in itertools.product((None, 0, 1), repeat=len(sizes)):
        load = [0, 0]
        for s, card in zip(sizes, assignment, strict=True):
            if card is not None:
                load[card] += s
        if max(load) <= 1000:
            best = max(best, sum(load))
    optimum = 100.0 - 100.0 * best / 2000
    assert packing_bound(fleet, pods).unallocated_pct <= optimum + 1e-9


def test_churn_bound_of_one_card() -> None:
    from octacloud.sim.bound import churn_bound

    card = [_node("a", 1)]
    # two running on average (rate 1/s × 2 s): 810s cannot share the card, so one runs at most
    only_810 = churn_bound(card, [_share("s", 810)], rate=1.0, mean_lifetime=2.0)
    assert only_810.offered_pct == pytest.approx(162.0)
    assert only_810.any_pct == pytest.approx(81.0) and only_810.proportional_pct == pytest.approx(81.0)
    # one whole card and one 810 on average: a discipline that lets the 810s wait fills the card; serving both
    # alike, each gets half of its arrivals through: (1000 + 810) / 2
    mixed = churn_bound(card, [Request("w", num_gpu=1, gpu_milli=1000), _share("s", 810)], 1.0, 2.0)
    assert mixed.any_pct == pytest.approx(100.0)
    assert mixed.proportional_pct == pytest.approx(90.5) and mixed.served_fraction == pytest.approx(0.5)
    # below capacity everything fits: the bounds are the offered load
    light = churn_bound([_node("a", 4)], [_share("s", 470), Request("w", num_gpu=1, gpu_milli=1000)], 1.0, 2.0)
    assert light.any_pct == light.proportional_pct == pytest.approx(light.offered_pct)
    assert light.served_fraction == pytest.approx(1.0)


def test_churn_bound_ignores_a_class_no_node_fits_when_serving_alike() -> None:
    from octacloud.sim.bound import churn_bound

    shapes = [Request("w", num_gpu=1, gpu_milli=1000), Request("big", num_gpu=4, gpu_milli=1000)]
    bound = churn_bound([_node("a", 2)], shapes, rate=1.0, mean_lifetime=2.0)
    assert bound.any_pct == pytest.approx(50.0) and bound.proportional_pct == pytest.approx(50.0)


def test_no_churn_run_allocates_more_than_its_bound() -> None:
    from octacloud.scheduler.framework import ClusterState, Scheduler
    from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
    from octacloud.scheduler.policies import build_profile
    from octacloud.sim.bound import churn_bound
    from octacloud.sim.churn import ChurnSimulation
    from octacloud.sim.reevaluate import LoopHook
    from octacloud.sim.synthetic import Lifetime, PoissonArrivals, synthetic_arrivals

    fleet = [_node(f"n{i}", cards, cpu=16_000) for i, cards in enumerate((1, 2, 2, 4))]
    shapes = [_share("a", 810), _share("b", 470), _share("c", 320), Request("w", num_gpu=1, gpu_milli=1000)]
    shapes.append(Request("m", num_gpu=2, gpu_milli=1000, cpu_milli=4000))
    rate, lifetime = 0.28, Lifetime("exponential", 40.0)  # offered ~ 115 %: the queue never empties
    bound = churn_bound(fleet, shapes, rate, lifetime.mean)
    assert bound.offered_pct > 110 and bound.proportional_pct < bound.any_pct < 100
    workload = TargetWorkload.from_requests(shapes)
    for policy in ("fgd", "octacloud"):
        state = ClusterState(fleet)
        scheduler = Scheduler(state, build_profile(policy, seed=1, workload=workload))
        loop = ReevaluationLoop(scheduler, LoopSettings(period=5.0, moves_per_pass=4))
        arrivals = synthetic_arrivals(shapes, PoissonArrivals(rate), lifetime, seed=3, until=8_000.0)
        sim = ChurnSimulation(
            scheduler,
            arrivals,
            until=8_000.0,
            queue=True,
            hooks=[LoopHook(loop)],
            warmup=1_000.0,
            admission=loop.admit,
        )
        achieved = sim.run().time_avg_allocated_pct
        assert 50 < achieved <= bound.any_pct + 0.5, (policy, achieved, bound)
