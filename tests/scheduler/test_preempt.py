"""Preemption: the cheapest set of strictly lower-priority victims on one node, committed only if it fits."""

from __future__ import annotations

from octacloud.core import Request
from octacloud.scheduler.actions.preempt import preempt, victims_on_node
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req, snapshot


def _full_cluster(*victims: tuple[Request, str, tuple[int, ...]]) -> Scheduler:
    state = ClusterState([node("a", 2), node("b", 2)])
    for r, where, cards in victims:
        place(state, r, where, cards)
    return Scheduler(state, build_profile("bestfit", seed=0))


def test_fits_without_preemption_evicts_nothing() -> None:
    scheduler = _full_cluster()
    result = preempt(scheduler, req("p", 1000, priority=5))
    assert result is not None and result.victims == []
    assert "p" in scheduler.state.allocations


def test_evicts_the_single_cheapest_victim() -> None:
    scheduler = _full_cluster(
        (req("a0", 1000, priority=3), "a", (0,)),
        (req("a1", 1000, priority=1), "a", (1,)),
        (req("b0", 1000, priority=2), "b", (0,)),
        (req("b1", 1000, priority=2), "b", (1,)),
    )
    result = preempt(scheduler, req("p", 1000, priority=5))
    assert result is not None
    assert [v.request.name for v in result.victims] == ["a1"]
    assert result.placement.node == "a" and result.placement.gpus == (1,)
    assert "a1" not in scheduler.state.allocations and "p" in scheduler.state.allocations
    check_invariants(scheduler.state)


def test_prefers_fewer_victims_over_lower_priority() -> None:
    scheduler = _full_cluster(
        (req("a0", 500, priority=1), "a", (0,)),
        (req("a0b", 500, priority=1), "a", (0,)),
        (req("a1", 1000, priority=1), "a", (1,)),
        (req("b0", 1000, priority=4), "b", (0,)),
        (req("b1", 1000, priority=4), "b", (1,)),
    )
    result = preempt(scheduler, req("p", 1000, priority=5))
    assert result is not None and [v.request.name for v in result.victims] == ["a1"]


def test_needs_several_victims_on_one_node() -> None:
    scheduler = _full_cluster(
        (req("a0", 1000, priority=1), "a", (0,)),
        (req("a1", 1000, priority=1), "a", (1,)),
        (req("b0", 1000, priority=9), "b", (0,)),
        (req("b1", 1000, priority=1), "b", (1,)),
    )
    result = preempt(scheduler, req("p", 1000, 2, priority=5))
    assert result is not None
    assert sorted(v.request.name for v in result.victims) == ["a0", "a1"]
    assert result.placement.gpus == (0, 1)
    check_invariants(scheduler.state)


def test_never_preempts_equal_or_higher_priority_and_changes_nothing() -> None:
    scheduler = _full_cluster(
        (req("a0", 1000, priority=5), "a", (0,)),
        (req("a1", 1000, priority=6), "a", (1,)),
        (req("b0", 1000, priority=5), "b", (0,)),
        (req("b1", 1000, priority=7), "b", (1,)),
    )
    before = snapshot(scheduler.state)
    assert preempt(scheduler, req("p", 1000, priority=5)) is None
    assert snapshot(scheduler.state) == before


def test_pinned_work_only_when_allowed() -> None:
    victims = [
        (req("a0", 1000, priority=1, pinned=True), "a", (0,)),
        (req("a1", 1000, priority=1, pinned=True), "a", (1,)),
        (req("b0", 1000, priority=1, pinned=True), "b", (0,)),
        (req("b1", 1000, priority=1, pinned=True), "b", (1,)),
    ]
    scheduler = _full_cluster(*victims)
    before = snapshot(scheduler.state)
    assert preempt(scheduler, req("p", 1000, priority=5)) is None
    assert snapshot(scheduler.state) == before
    result = preempt(scheduler, req("p", 1000, priority=5), allow_pinned=True)
    assert result is not None and len(result.victims) == 1


def test_victims_are_returned_for_replacement() -> None:
    scheduler = _full_cluster(
        (req("a0", 1000, priority=1), "a", (0,)),
        (req("a1", 1000, priority=1), "a", (1,)),
        (req("b0", 1000, priority=1), "b", (0,)),
        (req("b1", 500, priority=1), "b", (1,)),
    )
    result = preempt(scheduler, req("p", 1000, priority=5))
    assert result is not None
    (victim,) = result.victims
    assert victim.request.name == "b1"  # one victim either way; the least GPU evicted wins
    assert [op.kind for op in result.operations] == ["evict", "allocate"]
    check_invariants(scheduler.state)


def test_victims_on_node_is_preempts_choice_there_and_changes_nothing() -> None:
    victims = (
        (req("a0", 1000, priority=3), "a", (0,)),
        (req("a1", 1000, priority=1), "a", (1,)),
        (req("b0", 1000, priority=9), "b", (0,)),
        (req("b1", 1000, priority=9), "b", (1,)),
    )
    scheduler = _full_cluster(*victims)
    before = snapshot(scheduler.state)
    on_a = victims_on_node(scheduler, req("p", 1000, priority=5), scheduler.state.index["a"])
    assert on_a is not None and [v.request.name for v in on_a] == ["a1"]
    assert victims_on_node(scheduler, req("p", 1000, priority=5), scheduler.state.index["b"]) is None
    assert victims_on_node(scheduler, req("p", 1000, 2, priority=5), scheduler.state.index["a"]) is not None
    assert snapshot(scheduler.state) == before  # nothing evicted: the caller evicts
    done = preempt(_full_cluster(*victims), req("p", 1000, priority=5))
    assert done is not None and [v.request.name for v in done.victims] == ["a1"]


def test_victims_on_node_is_empty_when_the_pod_already_fits() -> None:
    scheduler = _full_cluster((req("a0", 1000, priority=1), "a", (0,)))
    assert victims_on_node(scheduler, req("p", 1000, priority=5), scheduler.state.index["a"]) == ()
