"""FGD's fragmentation measure on hand-computed cases, the target workload's definition, and the tracker."""

from __future__ import annotations

import math

import pytest

from octacloud.core import InvalidSpecError
from octacloud.scheduler.fragmentation import (
    FragmentationTracker,
    TargetWorkload,
    WorkloadShape,
    compile_workload,
    node_fragmentation,
)
from octacloud.scheduler.framework import ClusterState
from octacloud.scheduler.plugins.fgd import fgd_score
from tests.scheduler.helpers import node, place, req

SHARE = WorkloadShape(2000, 600, 1)
WHOLE2 = WorkloadShape(4000, 1000, 2)
CPU = WorkloadShape(8000, 0, 0)
T4_ONLY = WorkloadShape(1000, 500, 1, frozenset({"T4"}))


def frag(workload: TargetWorkload, free: list[int], cpu: int = 64_000, model: str = "T4") -> float:
    return compile_workload(workload).fragmentation(model, cpu, free)


@pytest.mark.parametrize(
    ("free", "cpu", "expected"),
    [
        # share 600 fits (card 1000): cards below 600 are fragment → 500 + 100
        ([1000, 500, 100], 64_000, 600.0),
        # too little CPU for the share: all idle GPU is fragment
        ([1000, 500, 100], 1_000, 1600.0),
        # no card holds 600: all idle GPU is fragment
        ([500, 100], 64_000, 600.0),
        # nothing idle: nothing to fragment
        ([0, 0], 64_000, 0.0),
    ],
)
def test_single_share_shape(free: list[int], cpu: int, expected: float) -> None:
    assert frag(TargetWorkload((SHARE,), (1.0,)), free, cpu) == expected


def test_mixture_weights_each_shape() -> None:
    workload = TargetWorkload((SHARE, WHOLE2, CPU), (0.5, 0.3, 0.2))
    free = [1000, 700, 300]
    # share: fits → 300 below 600; 2 whole cards: only one full card → all 2000; CPU-only: all 2000 idle
    assert frag(workload, free) == pytest.approx(0.5 * 300 + 0.3 * 2000 + 0.2 * 2000)


def test_gpu_model_constraint_makes_other_models_fragment() -> None:
    workload = TargetWorkload((T4_ONLY,), (1.0,))
    assert frag(workload, [1000, 300], model="T4") == 300.0
    assert frag(workload, [1000, 300], model="P100") == 1300.0


def test_card_order_and_cpu_within_a_threshold_bucket_do_not_matter() -> None:
    workload = TargetWorkload((SHARE, WHOLE2), (0.6, 0.4))
    assert frag(workload, [100, 1000, 500]) == frag(workload, [500, 100, 1000])
    assert frag(workload, [1000, 1000], cpu=5000) == frag(workload, [1000, 1000], cpu=60_000)
    assert frag(workload, [1000, 1000], cpu=3000) != frag(workload, [1000, 1000], cpu=5000)


def test_target_workload_keeps_most_frequent_shapes_up_to_coverage() -> None:
    requests = [req(f"a{k}", 500) for k in range(60)] + [req(f"b{k}", 1000) for k in range(30)]
    requests += [req(f"c{k}", cpu=3000) for k in range(6)] + [req(f"d{k}", 250) for k in range(4)]
    workload = TargetWorkload.from_requests(requests, coverage=0.95)
    assert [s.gpu_milli for s in workload.shapes] == [500, 1000, 0]
    assert workload.probabilities == pytest.approx((60 / 96, 30 / 96, 6 / 96))
    assert len(TargetWorkload.from_requests(requests, coverage=1.0).shapes) == 4


def test_target_workload_ties_prefer_larger_shapes() -> None:
    requests = [req("small", 200, cpu=1000), req("big", 200, cpu=9000)]
    workload = TargetWorkload.from_requests(requests, coverage=0.5)
    assert workload.shapes == (WorkloadShape(9000, 200, 1),)


@pytest.mark.parametrize(
    ("shapes", "probabilities", "message"),
    [
        ((SHARE,), (0.5,), "must sum to 1"),
        ((SHARE, CPU), (1.0,), "2 shapes but 1 probabilities"),
        ((SHARE,), (math.nan,), "must be in"),
        ((), (), "at least one shape"),
    ],
)
def test_bad_workloads_are_rejected(
    shapes: tuple[WorkloadShape, ...], probabilities: tuple[float, ...], message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        TargetWorkload(shapes, probabilities)


def test_fgd_score_is_the_authors_integer_sigmoid() -> None:
    assert fgd_score(1000.0, 1000.0) == 50
    assert fgd_score(1400.0, 1000.0) == 59  # sigmoid(0.4) = 0.5987 → 59
    assert fgd_score(1000.0, 1030.0) == 49  # small increases tie with each other, as in the authors' code
    assert fgd_score(1000.0, 1020.0) == 49


def test_tracker_follows_the_state_incrementally() -> None:
    workload = TargetWorkload((SHARE, WHOLE2, CPU), (0.5, 0.3, 0.2))
    state = ClusterState([node("a", 2), node("b", 4), node("c", 8)])
    tracker = FragmentationTracker(state, workload)
    steps = [(req("x", 300), "a", (0,)), (req("y", 1000, 2), "b", (0, 1)), (req("z", 700), "c", (5,))]
    for r, where, cards in steps:
        place(state, r, where, cards)
        tracker.update(state.node_index(where))
        expected = sum(node_fragmentation(state, i, workload) for i in range(len(state)))
        assert tracker.total == pytest.approx(expected)
    state.release("y")
    tracker.refresh()
    assert tracker.total == pytest.approx(sum(node_fragmentation(state, i, workload) for i in range(len(state))))
    assert 0.0 < tracker.rate() <= 1.0
    assert tracker.idle_gpu_milli() == state.total_gpu_milli - state.allocated_gpu_milli


def test_fgd_caches_never_change_a_decision() -> None:
    from octacloud.scheduler.framework import Scheduler
    from octacloud.scheduler.policies import build_profile

    workload = TargetWorkload((SHARE, WHOLE2, CPU, T4_ONLY), (0.4, 0.2, 0.2, 0.2))
    nodes = [node(f"t{i}", 1 + i % 4, model="T4") for i in range(6)] + [
        node(f"p{i}", 2, model="P100") for i in range(4)
    ]
    requests = [
        req(
            f"r{k}",
            (0, 300, 600, 1000)[k % 4],
            1 + (k % 8 == 3),
            cpu=500 + 300 * (k % 5),
            gpu_mib=(k % 3) * 1000,
            models=["T4"] if k % 6 == 0 else [],
        )
        for k in range(60)
    ]
    cached = Scheduler(ClusterState(nodes), build_profile("fgd", seed=3, workload=workload))
    fresh_state = ClusterState(nodes)
    for r in requests:
        fresh = Scheduler(fresh_state, build_profile("fgd", seed=3, workload=workload)).decide(r)
        got = cached.schedule(r)
        assert got.placement == fresh.placement, r.name
        if fresh.placement is not None:
            fresh_state.allocate(fresh.request, fresh.placement)
