"""Defragmentation: minimal moves, make-before-break, budgets, permissions, and exact rollback."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octacloud.core.errors import InvalidSpecError
from octacloud.scheduler.actions.defragment import SHADOW_SUFFIX, defragment
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req, snapshot


def _scheduler(state: ClusterState, policy: str = "bestfit") -> Scheduler:
    return Scheduler(state, build_profile(policy, seed=1))


def _fragmented() -> ClusterState:
    """Two 2-card nodes, each with one card half used: 1 000 milli free in total but no whole card."""
    state = ClusterState([node("a"), node("b")])
    place(state, req("x", 500), "a", (0,))
    place(state, req("y", 500), "b", (0,))
    place(state, req("u", 1000), "a", (1,))
    place(state, req("v", 1000), "b", (1,))
    return state


def test_one_move_makes_a_whole_card() -> None:
    state = _fragmented()
    scheduler = _scheduler(state)
    assert scheduler.decide(req("p", 1000)).placement is None
    outcome = defragment(scheduler, req("p", 1000))
    assert outcome is not None and len(outcome.moves) == 1
    move = outcome.moves[0]
    assert move.request.name in {"x", "y"} and move.source.node != move.destination.node
    assert outcome.placement.node == move.source.node and outcome.placement.gpus == move.source.gpus
    check_invariants(state)
    assert state.allocations[move.request.name].placement == move.destination
    assert not any(name.endswith(SHADOW_SUFFIX) for name in state.allocations)


def test_make_before_break_order_in_the_log() -> None:
    state = _fragmented()
    outcome = defragment(_scheduler(state), req("p", 1000))
    assert outcome is not None
    kinds = [(op.kind, op.request.name) for op in outcome.operations]
    moved = outcome.moves[0].request.name
    # reserve the destination (shadow), release the source, then the shadow becomes the replica's allocation
    assert kinds[:4] == [
        ("allocate", moved + SHADOW_SUFFIX),
        ("evict", moved),
        ("evict", moved + SHADOW_SUFFIX),
        ("allocate", moved),
    ]
    assert kinds[4] == ("allocate", "p")


def test_pinned_and_higher_priority_work_stays_unless_allowed() -> None:
    for kwargs in ({"pinned": True}, {"priority": 5}):
        state = ClusterState([node("a"), node("b")])
        place(state, req("x", 500, **kwargs), "a", (0,))  # type: ignore[arg-type]
        place(state, req("y", 500, **kwargs), "b", (0,))  # type: ignore[arg-type]
        place(state, req("u", 1000, **kwargs), "a", (1,))  # type: ignore[arg-type]
        place(state, req("v", 1000, **kwargs), "b", (1,))  # type: ignore[arg-type]
        before = snapshot(state)
        scheduler = _scheduler(state)
        assert defragment(scheduler, req("p", 1000)) is None
        assert snapshot(state) == before
        allow = {"allow_pinned": True} if "pinned" in kwargs else {"allow_higher_priority": True}
        assert defragment(scheduler, req("p", 1000), **allow) is not None  # type: ignore[arg-type]


def test_budget_limits_moves() -> None:
    # Four 500 shares on four cards: a 2-card request needs one node's two shares moved onto the other's cards.
    state = ClusterState([node("a"), node("b")])
    for name, where, card in (("x", "a", 0), ("y", "a", 1), ("z", "b", 0), ("w", "b", 1)):
        place(state, req(name, 500), where, (card,))
    before = snapshot(state)
    scheduler = _scheduler(state)
    assert defragment(scheduler, req("p", 1000, 2), max_moves=1) is None
    assert snapshot(state) == before
    outcome = defragment(scheduler, req("p", 1000, 2), max_moves=2)
    assert outcome is not None and len(outcome.moves) == 2
    assert {m.source.node for m in outcome.moves} == {outcome.placement.node}
    check_invariants(state)
    with pytest.raises(InvalidSpecError, match="max_moves"):
        defragment(scheduler, req("q", 500), max_moves=-1)


def test_no_plan_leaves_the_state_exactly() -> None:
    state = ClusterState([node("a", 1), node("b", 1)])
    place(state, req("x", 600), "a", (0,))
    place(state, req("y", 600), "b", (0,))
    before = snapshot(state)
    assert defragment(_scheduler(state), req("p", 1000)) is None  # nowhere to move a 600 share
    assert snapshot(state) == before


def test_fits_directly_without_moves() -> None:
    state = ClusterState([node("a")])
    outcome = defragment(_scheduler(state), req("p", 1000))
    assert outcome is not None and outcome.moves == []
    assert "p" in state.allocations


@settings(max_examples=40, deadline=None)
@given(
    shares=st.lists(st.sampled_from([250, 300, 470, 500, 650, 1000]), min_size=1, max_size=10),
    want=st.sampled_from([(1000, 1), (1000, 2), (810, 1)]),
    policy=st.sampled_from(["bestfit", "fgd", "octacloud"]),
)
def test_no_move_strands_a_replica(shares: list[int], want: tuple[int, int], policy: str) -> None:
    """Every replica is allocated exactly once after a commit; a failed plan restores the exact state."""
    from octacloud.scheduler.fragmentation import TargetWorkload

    state = ClusterState([node("a", 2), node("b", 2), node("c", 4)])
    workload = TargetWorkload.from_requests([req("w", s) for s in shares])
    scheduler = Scheduler(state, build_profile(policy, seed=3, workload=workload))
    for k, milli in enumerate(shares):
        scheduler.schedule(req(f"r{k}", milli))
    running = {name: a.request for name, a in state.allocations.items()}
    before = snapshot(state)
    outcome = defragment(scheduler, req("p", want[0], want[1]))
    check_invariants(state)
    if outcome is None:
        assert snapshot(state) == before
        return
    names = Counter(a.request.name for a in state)
    assert all(n == 1 for n in names.values())
    assert set(names) == {*running, "p"}
    for move in outcome.moves:
        assert state.allocations[move.request.name].placement == move.destination
        assert state.allocations[move.request.name].request == running[move.request.name]
