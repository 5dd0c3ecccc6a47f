"""The re-evaluation loop: timing on an injected clock, place → preempt → defragment, budgets."""

from __future__ import annotations

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Placement
from octacloud.scheduler.framework import ClusterState, CycleContext, ReservePlugin, Scheduler
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req


def _loop(state: ClusterState, **settings: object) -> ReevaluationLoop:
    ticks = iter(float(k) for k in range(1000))
    return ReevaluationLoop(
        Scheduler(state, build_profile("bestfit", seed=2)),
        LoopSettings(**settings),  # type: ignore[arg-type]
        timer=lambda: next(ticks),
    )


def test_due_every_period_on_the_injected_clock() -> None:
    loop = _loop(ClusterState([node("a")]), period=5.0)
    assert loop.due(0.0)
    loop.run_pass(0.0, [])
    assert not loop.due(4.999)
    assert loop.due(5.0)
    report = loop.run_pass(5.0, [])
    assert report.started == 5.0 and report.seconds == 1.0  # the injected timer, not the wall clock
    assert loop.passes == 2


def test_places_pending_highest_priority_first() -> None:
    state = ClusterState([node("a", 1)])
    report = _loop(state).run_pass(0.0, [req("low", 1000), req("high", 1000, priority=5)])
    assert list(report.placed) == ["high"]
    assert [r.name for r in report.pending] == ["low"]
    check_invariants(state)


def test_preempts_lower_priority_and_returns_victims() -> None:
    state = ClusterState([node("a", 1)])
    place(state, req("batch", 1000), "a", (0,))
    report = _loop(state, defragment=False).run_pass(0.0, [req("urgent", 1000, priority=10)])
    assert "urgent" in report.placed
    assert [v.request.name for v in report.preempted] == ["batch"]
    assert [r.name for r in report.pending] == ["batch"]
    check_invariants(state)


def test_no_preemption_when_switched_off_or_equal_priority() -> None:
    state = ClusterState([node("a", 1)])
    place(state, req("batch", 1000), "a", (0,))
    assert _loop(state, preempt=False, defragment=False).run_pass(0.0, [req("u", 1000, priority=9)]).placed == {}
    assert _loop(state, defragment=False).run_pass(0.0, [req("peer", 1000)]).placed == {}


def test_defragments_within_the_pass_budget() -> None:
    state = ClusterState([node("a"), node("b")])
    place(state, req("x", 500), "a", (0,))
    place(state, req("y", 500), "b", (0,))
    place(state, req("u", 1000), "a", (1,))
    place(state, req("v", 1000), "b", (1,))
    assert _loop(state, moves_per_pass=0).run_pass(0.0, [req("p", 1000)]).placed == {}
    assert _loop(state, defrag_attempts=0).run_pass(0.0, [req("p", 1000)]).placed == {}
    loop = _loop(state, moves_per_pass=1)
    report = loop.run_pass(0.0, [req("p", 1000), req("q", 1000)])
    assert list(report.placed) == ["p"] and len(report.moves) == 1 and loop.total_moves == 1
    assert [r.name for r in report.pending] == ["q"]
    check_invariants(state)


def test_invalid_settings() -> None:
    with pytest.raises(InvalidSpecError, match="period"):
        LoopSettings(period=0)
    with pytest.raises(InvalidSpecError, match="budgets"):
        LoopSettings(moves_per_pass=-1)
    with pytest.raises(InvalidSpecError, match="defrag_attempts"):
        LoopSettings(defrag_attempts=-1)


class CountingReserver:
    """A reserve plugin that keeps its own count of what each card holds (as a cache of a real plugin would)."""

    name = "counting"

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}

    def reserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None:
        for g in cards:
            self.held[(node, g)] = self.held.get((node, g), 0) + ctx.request.gpu_milli

    def unreserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None:
        for g in cards:
            self.held[(node, g)] -= ctx.request.gpu_milli

    def matches(self, state: ClusterState) -> bool:
        used = {(i, g): 1000 - free for i, frees in enumerate(state.free_gpu) for g, free in enumerate(frees)}
        return all(self.held.get(k, 0) == v for k, v in used.items())


def test_reserve_plugins_follow_every_allocate_evict_and_undo() -> None:
    state = ClusterState([node("a"), node("b")])
    scheduler = Scheduler(state, build_profile("bestfit", seed=2))
    counting = CountingReserver()
    assert isinstance(counting, ReservePlugin)
    scheduler.profile.reservers.append(counting)
    for name, milli, where, card in (("x", 500, "a", 0), ("y", 500, "b", 0), ("u", 1000, "a", 1), ("v", 1000, "b", 1)):
        scheduler.commit(req(name, milli), Placement(name, where, (card,), milli))
    loop = ReevaluationLoop(scheduler, LoopSettings())
    assert loop.run_pass(0.0, [req("p", 1000)]).moves  # defragments, with trial plans that rolled back
    assert counting.matches(state)
    assert loop.run_pass(5.0, [req("urgent", 1000, priority=9)]).preempted
    assert counting.matches(state)
    scheduler.release("urgent")
    assert counting.matches(state)
    with scheduler.transaction() as tx:
        tx.evict("u")
        tx.allocate(req("w", 500), Placement("w", "a", (1,), 500))
        assert counting.matches(state)
    assert counting.matches(state) and "u" in state.allocations and "w" not in state.allocations  # rolled back
