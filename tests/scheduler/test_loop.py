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


# ---- the queue discipline: reservations and backfill --------------------------------------------------------


def _fragmented() -> ClusterState:
    """Node a: one card busy with a share, one free; node b: both cards busy with a share each."""
    state = ClusterState([node("a", cpu=8000), node("b", cpu=8000)])
    place(state, req("s1", 300), "a", (0,))
    place(state, req("s2", 300), "b", (0,))
    place(state, req("s3", 300), "b", (1,))
    return state


def test_the_head_that_fits_nowhere_reserves_the_node_where_it_fits_soonest() -> None:
    state = _fragmented()
    loop = _loop(state, defragment=False)
    report = loop.run_pass(0.0, [req("big", 1000, cards=2, cpu=4000), req("small", 1000)])
    (res,) = report.reservations
    assert res.request.name == "big" and state.nodes[res.node].name == "a" and res.cards == (0, 1)
    assert res.blockers(state) == ["s1"] and res.blocking == 1
    assert report.placed == {} and [r.name for r in report.pending] == ["big", "small"]  # a's free card is held
    check_invariants(state)


def test_without_reservations_the_small_request_takes_the_freed_card() -> None:
    state = _fragmented()
    report = _loop(state, defragment=False, reservations=0).run_pass(
        0.0, [req("big", 1000, cards=2, cpu=4000), req("small", 1000)]
    )
    assert list(report.placed) == ["small"] and report.reservations == []


def test_backfill_may_use_what_the_reservation_does_not_need() -> None:
    state = ClusterState([node("a", 4, cpu=8000)])
    place(state, req("s1", 300, cpu=1000), "a", (0,))
    place(state, req("s2", 600, cpu=1000), "a", (1,))
    loop = _loop(state, defragment=False)
    report = loop.run_pass(0.0, [req("big", 1000, cards=3, cpu=4000)])
    (res,) = report.reservations
    assert res.cards == (0, 2, 3)  # the free cards, then the busy card with the fewest blockers, least used
    # spare CPU for others: 6000 free + s1's 1000 (it leaves before the holder starts) - the holder's 4000
    assert loop.admit(req("too-hungry", 300, cpu=3001)).placement is None
    fits = loop.admit(req("fits", 300, cpu=3000)).placement
    assert fits is not None and fits.gpus == (1,)  # beside s2, never on a reserved card
    assert loop.admit(req("whole", 1000, cpu=0)).placement is None  # only reserved cards are whole
    assert loop.admit(req("vip", 1000, cpu=0, priority=5)).placement is not None  # outranks the holder
    check_invariants(state)


def test_the_holder_is_placed_when_its_blockers_leave_and_admissions_never_took_its_cards() -> None:
    state = _fragmented()
    scheduler_loop = _loop(state, defragment=False)
    scheduler_loop.run_pass(0.0, [req("big", 1000, cards=2, cpu=4000)])
    assert scheduler_loop.admit(req("small", 1000)).placement is None  # b is full; a's free card is reserved
    state.release("s1")
    assert scheduler_loop.admit(req("small", 1000)).placement is None  # both of a's cards are the holder's now
    report = scheduler_loop.run_pass(5.0, [req("big", 1000, cards=2, cpu=4000), req("small", 1000)])
    assert report.placed["big"].node == "a" and "small" not in report.placed  # nothing left for it
    assert [(r.request.name, state.nodes[r.node].name) for r in report.reservations] == [("small", "b")]
    check_invariants(state)


def test_a_holder_short_of_cpu_reserves_with_the_cpu_only_work_it_waits_for() -> None:
    """Every node runs a little CPU-only work, so no node gives the head (both cards and most of the CPU) enough
    CPU once the replicas on its cards leave. It reserves the node whose CPU-only work it waits for anyway; a
    younger request does not take that node's cards, and backfill keeps to the CPU the head leaves."""
    state = ClusterState([node("a", cpu=8000), node("b", cpu=8000)])
    place(state, req("cpu-a", 0, cards=0, cpu=2000), "a")
    place(state, req("cpu-b", 0, cards=0, cpu=7000), "b")
    place(state, req("s", 300), "b", (0,))  # b's CPU is all taken
    big, younger = req("big", 1000, cards=2, cpu=7000), req("younger", 1000, cards=2, cpu=1000)
    loop = _loop(state, defragment=False)
    report = loop.run_pass(0.0, [big, younger])
    (res,) = report.reservations
    assert res.request.name == "big" and state.nodes[res.node].name == "a" and res.others == {"cpu-a"}
    assert res.blockers(state) == ["cpu-a"] and res.blocking == 1
    assert report.placed == {}  # a's whole cards are held for big; b has a share on one
    # spare CPU on a: 6000 free + cpu-a's 2000 (it leaves before big starts) - big's 7000
    assert loop.admit(req("cpu-more", 0, cards=0, cpu=1001)).placement is None
    fits = loop.admit(req("cpu-fits", 0, cards=0, cpu=1000)).placement
    assert fits is not None and fits.node == "a"
    state.release("cpu-fits")
    state.release("cpu-a")
    assert loop.run_pass(5.0, [big, younger]).placed["big"].node == "a"
    check_invariants(state)


def test_a_reservation_without_progress_is_chosen_again_and_one_whose_holder_left_is_dropped() -> None:
    state = _fragmented()
    loop = _loop(state, defragment=False, reservation_passes=2)
    big = req("big", 1000, cards=2, cpu=4000)
    first = loop.run_pass(0.0, [big]).reservations[0]
    assert loop.run_pass(5.0, [big]).reservations[0].made == first.made
    assert loop.run_pass(10.0, [big]).reservations[0].made == 2  # expired after 2 passes, made again
    assert loop.run_pass(15.0, []).reservations == [] and loop.reserved == {}


def test_a_higher_priority_arrival_ignores_a_lower_priority_reservation() -> None:
    state = _fragmented()
    loop = _loop(state, defragment=False)
    loop.run_pass(0.0, [req("big", 1000, cards=2, cpu=4000)])
    assert loop.admit(req("peer", 1000)).placement is None
    assert loop.admit(req("vip", 1000, priority=1)).placement is not None


def test_defragmentation_clears_the_reserved_node_all_or_nothing() -> None:
    state = _fragmented()
    loop = _loop(state)
    report = loop.run_pass(0.0, [req("big", 1000, cards=2, cpu=4000)])
    assert report.placed["big"].node == "a"
    assert [(m.request.name, m.destination.node) for m in report.moves] == [("s1", "b")]
    assert report.operations[-1].after == ("s1",)  # type: ignore[union-attr]
    check_invariants(state)


def test_defragmentation_leaves_a_reservation_whose_blocker_is_pinned_to_departures() -> None:
    state = ClusterState([node("a", cpu=8000), node("b", cpu=8000)])
    place(state, req("s1", 300, pinned=True), "a", (0,))
    place(state, req("s2", 300, pinned=True), "b", (0,))
    place(state, req("s3", 300), "b", (1,))
    loop = _loop(state)
    report = loop.run_pass(0.0, [req("big", 1000, cards=2, cpu=4000)])
    assert report.placed == {} and report.moves == []
    before = {a.request.name: a.placement for a in state}
    assert loop.run_pass(5.0, [req("big", 1000, cards=2, cpu=4000)]).moves == []
    assert {a.request.name: a.placement for a in state} == before


def test_invalid_reservation_settings() -> None:
    with pytest.raises(InvalidSpecError, match="reservations"):
        LoopSettings(reservations=-1)
    with pytest.raises(InvalidSpecError, match="reservation_passes"):
        LoopSettings(reservation_passes=0)


def _lone_shares() -> ClusterState:
    """Nodes a, b, c of one card each: a 470 alone on a and on b, a whole-card replica on c. No card is whole."""
    state = ClusterState([node("a", 1, cpu=8000), node("b", 1, cpu=8000), node("c", 1, cpu=8000)])
    place(state, req("x", 470), "a", (0,))
    place(state, req("y", 470), "b", (0,))
    place(state, req("w", 1000), "c", (0,))
    return state


def test_pairing_two_lone_shares_frees_a_card_for_a_waiting_whole_card_request() -> None:
    state = _lone_shares()
    # the per-request plans may move nothing (moves_per_request=0); the pairing step alone moves a share
    loop = _loop(state, reservations=0, moves_per_request=0)
    report = loop.run_pass(0.0, [req("p", 1000)])
    (move,) = report.moves
    assert move.request.name in ("x", "y") and move.destination.gpus == (0,)
    assert report.placed["p"].node == move.source.node  # the freed card
    assert report.operations[-1].after == (move.request.name,)  # type: ignore[union-attr]
    assert sorted(a.request.name for a in state.on_node[state.node_index(move.destination.node)].values()) == [
        "x",
        "y",
    ]
    check_invariants(state)


def test_pairing_is_make_before_break_and_rolled_back_when_nothing_can_start() -> None:
    state = _lone_shares()
    before = {a.request.name: a.placement for a in state}
    loop = _loop(state, reservations=0, moves_per_request=0)
    # needs more CPU than a freed node has: the move would free a card for nothing, so none is made
    assert loop.run_pass(0.0, [req("hungry", 1000, cpu=9000)]).moves == []
    assert {a.request.name: a.placement for a in state} == before
    # nothing waits that takes GPU: no move
    assert loop.run_pass(5.0, [req("cpu-only", 0, cpu=99_000)]).moves == []
    # switched off, or no budget left: nothing moves
    assert (
        _loop(state, reservations=0, moves_per_request=0, pair_shares=False).run_pass(0.0, [req("p", 1000)]).moves == []
    )
    assert _loop(state, reservations=0, moves_per_pass=0).run_pass(0.0, [req("p", 1000)]).moves == []
    assert {a.request.name: a.placement for a in state} == before
    check_invariants(state)


class RecordingReserver:
    """A reserve plugin that records every reserve and unreserve, in order."""

    name = "recording"

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def reserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None:
        self.log.append(("reserve", ctx.request.name))

    def unreserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None:
        self.log.append(("unreserve", ctx.request.name))


def test_a_pairing_move_holds_its_destination_before_it_leaves_its_source() -> None:
    state = _lone_shares()
    scheduler = Scheduler(state, build_profile("bestfit", seed=2))
    recording = RecordingReserver()
    scheduler.profile.reservers.append(recording)
    loop = ReevaluationLoop(scheduler, LoopSettings(reservations=0, moves_per_request=0))
    (move,) = loop.run_pass(0.0, [req("p", 1000)]).moves
    name = move.request.name
    committed = recording.log[-5:]  # trials that rolled back come before; the committed plan is the last steps
    assert committed == [
        ("reserve", name + "@move"),
        ("unreserve", name),
        ("unreserve", name + "@move"),
        ("reserve", name),
        ("reserve", "p"),
    ]
    check_invariants(state)


def test_pairing_frees_a_card_for_a_waiting_share_that_fits_no_remainder() -> None:
    state = _lone_shares()
    report = _loop(state, reservations=0, moves_per_request=0).run_pass(0.0, [req("big-share", 810)])
    (move,) = report.moves
    assert report.placed["big-share"].node == move.source.node
    check_invariants(state)


def test_pairing_leaves_pinned_shares() -> None:
    state = ClusterState([node("a", 1, cpu=8000), node("b", 1, cpu=8000), node("c", 1, cpu=8000)])
    place(state, req("x", 470, pinned=True), "a", (0,))
    place(state, req("y", 470, pinned=True), "b", (0,))
    place(state, req("w", 1000), "c", (0,))
    loop = _loop(state, reservations=0, moves_per_request=0)
    assert loop.run_pass(0.0, [req("p", 1000)]).moves == []


def test_pairing_moves_no_share_for_a_request_of_lower_priority() -> None:
    state = ClusterState([node("a", 1, cpu=8000), node("b", 1, cpu=8000), node("c", 1, cpu=8000)])
    place(state, req("x", 470, priority=5), "a", (0,))
    place(state, req("y", 470, priority=5), "b", (0,))
    place(state, req("w", 1000), "c", (0,))
    loop = _loop(state, reservations=0, moves_per_request=0, preempt=False)
    assert loop.run_pass(0.0, [req("p", 1000)]).moves == []
    assert loop.run_pass(5.0, [req("q", 1000, priority=5)]).moves != []
    check_invariants(state)
