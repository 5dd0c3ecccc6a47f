"""Churn mode on simulated time: hand-made cases for the time average, the queue, eviction and invariants."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from octacloud.core.clock import ManualClock
from octacloud.core.model import Gpu, Node, Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework import ClusterState, CycleContext, Profile, Scheduler, default_cards
from octacloud.sim.churn import ChurnSimulation
from octacloud.sim.synthetic import Arrival


def _fleet(*cards: int) -> list[Node]:
    return [
        Node(f"n{i}", 64_000, 256 * 1024, tuple(Gpu(g, "T4", 16 * 1024) for g in range(n))) for i, n in enumerate(cards)
    ]


class _Fits:
    """The smallest filter: nodes with enough CPU, memory and cards for the request."""

    name = "fits"

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        r, s = ctx.request, ctx.state
        return [
            i
            for i in nodes
            if s.free_cpu[i] >= r.cpu_milli and s.free_memory[i] >= r.memory_mib and default_cards(s, r, i) is not None
        ]


def _scheduler(*cards: int) -> Scheduler:
    return Scheduler(ClusterState(_fleet(*cards)), Profile("first-fit", filters=[_Fits()]))


def _gpu(name: str, milli: int) -> Request:
    return Request(name, num_gpu=1, gpu_milli=milli)


def test_time_average_of_a_hand_made_case() -> None:
    # One card; 500 milli allocated from t=10 to t=30 of a 40 s run: (500 × 20) / (1000 × 40) = 25 %.
    clock = ManualClock()
    sim = ChurnSimulation(_scheduler(1), [Arrival(10.0, _gpu("a", 500), 20.0)], until=40.0, clock=clock)
    report = sim.run()
    assert report.time_avg_allocated_pct == pytest.approx(25.0)
    assert (report.arrivals, report.placed, report.completed, report.failed) == (1, 1, 1, 0)
    assert clock.monotonic() == 40.0
    assert sim.timeline == [(0.0, 0), (10.0, 500), (30.0, 0)]


def test_warmup_is_left_out_of_the_average() -> None:
    # Allocated 1000 on [0, 20); measured window [10, 40): 1000 × 10 / (1000 × 30).
    sim = ChurnSimulation(_scheduler(1), [Arrival(0.0, _gpu("a", 1000), 20.0)], until=40.0, warmup=10.0)
    assert sim.run().time_avg_allocated_pct == pytest.approx(100 / 3)


def test_without_a_queue_work_that_does_not_fit_fails() -> None:
    arrivals = [Arrival(0.0, _gpu("a", 1000), 10.0), Arrival(1.0, _gpu("b", 1000), 10.0)]
    report = ChurnSimulation(_scheduler(1), arrivals, until=30.0).run()
    assert (report.placed, report.failed, report.queued_at_end) == (1, 1, 0)
    assert report.time_avg_allocated_pct == pytest.approx(100 / 3)
    assert report.reevaluations == 0


def test_with_a_queue_work_waits_for_the_next_reevaluation() -> None:
    # b waits from t=1; a departs at t=10, and the tick at t=10 runs after the departure: b runs [10, 20).
    arrivals = [Arrival(0.0, _gpu("a", 1000), 10.0), Arrival(1.0, _gpu("b", 1000), 10.0)]
    sim = ChurnSimulation(_scheduler(1), arrivals, until=30.0, queue=True, period=5.0)
    report = sim.run()
    assert (report.placed, report.failed, report.queued_at_end, report.max_queue) == (2, 0, 0, 1)
    assert report.mean_wait_seconds == pytest.approx(9.0 / 2)
    assert report.time_avg_allocated_pct == pytest.approx(200 / 3)
    assert report.reevaluations == 6  # t = 5, 10, ..., 30


def test_requests_still_waiting_at_the_end_are_reported() -> None:
    arrivals = [Arrival(0.0, _gpu("a", 1000), 100.0), Arrival(1.0, _gpu("b", 600), 10.0)]
    report = ChurnSimulation(_scheduler(1), arrivals, until=30.0, queue=True).run()
    assert (report.placed, report.queued_at_end) == (1, 1)


def test_eviction_requeues_with_the_remaining_lifetime_and_cancels_the_old_departure() -> None:
    evicted: list[float] = []

    def preempt_once(sim: ChurnSimulation) -> None:
        if not evicted and "a" in sim.running:
            evicted.append(sim.now)
            sim.evict("a")  # at t=5, with 15 s of its 20 s left

    arrivals = [Arrival(0.0, _gpu("a", 1000), 20.0)]
    hooks = [preempt_once, _retry_after_eviction]
    sim = ChurnSimulation(_scheduler(1), arrivals, until=60.0, queue=True, period=5.0, hooks=hooks)
    report = sim.run()
    assert evicted == [5.0]
    # Re-placed at the t=10 tick with 15 s left: runs [0, 5) and [10, 25) → 20 s of 60.
    assert report.time_avg_allocated_pct == pytest.approx(100 * 20 / 60)
    assert report.completed == 1 and report.placed == 2


def _retry_after_eviction(sim: ChurnSimulation) -> None:
    if sim.now < 10.0:
        return
    for item in sim.take_pending():
        if not sim.try_place(item.request, item.lifetime, since=item.since):
            sim.pending.append(item)


def test_hooks_may_move_running_work_without_breaking_departures() -> None:
    from octacloud.core.model import Placement
    from octacloud.scheduler.framework import Transaction

    def move_to_n1(sim: ChurnSimulation) -> None:
        allocation = sim.state.allocations.get("a")
        if allocation is not None and allocation.placement.node == "n0":
            with Transaction(sim.state) as tx:
                tx.move("a", Placement("a", "n1", (0,), 500))
                tx.commit()

    sim = ChurnSimulation(
        _scheduler(1, 1), [Arrival(0.0, _gpu("a", 500), 12.0)], until=20.0, period=5.0, hooks=[move_to_n1]
    )
    report = sim.run()
    assert report.completed == 1 and sim.state.allocated_gpu_milli == 0
    assert report.time_avg_allocated_pct == pytest.approx(100 * 500 * 12 / (2000 * 20))


def test_allocation_never_exceeds_capacity_under_random_churn() -> None:
    rng = random.Random(3)
    arrivals: list[Arrival] = []
    t = 0.0
    for k in range(400):
        t += rng.expovariate(0.5)
        n = rng.choice([1, 1, 1, 2, 4])
        milli = rng.choice([125, 250, 460, 500, 1000]) if n == 1 else MILLI_PER_GPU
        arrivals.append(Arrival(t, Request(f"r{k}", num_gpu=n, gpu_milli=milli, cpu_milli=2000), rng.uniform(1, 60)))
    checks: list[int] = []

    def check(sim: ChurnSimulation) -> None:
        state = sim.state
        for i in range(len(state)):
            assert all(0 <= f <= MILLI_PER_GPU for f in state.free_gpu[i])
            assert state.free_cpu[i] >= 0
        assert state.allocated_gpu_milli == sum(a.request.total_gpu_milli for a in state)
        assert set(state.allocations) == set(sim.running)
        checks.append(state.allocated_gpu_milli)

    sched = _scheduler(2, 4, 8)
    sim = ChurnSimulation(sched, arrivals, until=t + 1000, queue=True, period=5.0, hooks=[check, _retry_all])
    report = sim.run()
    capacity = sched.state.total_gpu_milli
    assert checks and max(checks) <= capacity
    assert max(a for _, a in sim.timeline) <= capacity
    assert 0 < report.time_avg_allocated_pct <= 100
    assert report.arrivals == 400 and report.placed == 400 and report.queued_at_end == 0
    assert report.completed == report.placed  # the queue drained and everything ran out in the tail


def _retry_all(sim: ChurnSimulation) -> None:
    for item in list(sim.pending):
        if sim.try_place(item.request, item.lifetime, since=item.since):
            sim.pending.remove(item)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"until": 0.0}, "until must be > 0"),
        ({"until": 10.0, "warmup": 10.0}, "warmup"),
        ({"until": 10.0, "period": 0.0}, "period"),
    ],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChurnSimulation(_scheduler(1), [], **kwargs)  # type: ignore[arg-type]


def test_arrivals_out_of_order_are_rejected() -> None:
    arrivals = [Arrival(5.0, _gpu("a", 100), 1.0), Arrival(2.0, _gpu("b", 100), 1.0)]
    with pytest.raises(ValueError, match="time order"):
        ChurnSimulation(_scheduler(1), arrivals, until=10.0).run()


def test_a_hook_may_place_pending_work_itself() -> None:
    def place_myself(sim: ChurnSimulation) -> None:
        for item in sim.take_pending():
            decision = sim.scheduler.decide(item.request)
            if decision.placement is None:
                sim.pending.append(item)
                continue
            sim.state.allocate(item.request, decision.placement)
            sim.start_placed(item.request, item.lifetime, since=item.since)

    arrivals = [Arrival(0.0, _gpu("a", 1000), 8.0), Arrival(1.0, _gpu("b", 1000), 4.0)]
    sim = ChurnSimulation(_scheduler(1), arrivals, until=20.0, queue=True, period=5.0, hooks=[place_myself])
    report = sim.run()
    # a runs [0, 8); b waits from 1 to the t=10 tick and runs [10, 14).
    assert (report.placed, report.completed, report.queued_at_end) == (2, 2, 0)
    assert report.mean_wait_seconds == pytest.approx(9.0 / 2)
    assert report.time_avg_allocated_pct == pytest.approx(100 * 12 / 20)
    with pytest.raises(ValueError, match="not allocated"):
        sim.start_placed(_gpu("c", 100), 1.0, since=0.0)


def test_the_default_retry_skips_failed_shapes_without_changing_outcomes() -> None:
    rng = random.Random(11)
    arrivals: list[Arrival] = []
    t = 0.0
    for k in range(300):
        t += rng.expovariate(1.0)
        milli = rng.choice([250, 500, 1000])
        arrivals.append(Arrival(t, Request(f"r{k}", num_gpu=1, gpu_milli=milli), rng.uniform(5, 40)))
    naive = ChurnSimulation(_scheduler(2, 4), arrivals, until=t + 50, queue=True, hooks=[_retry_all])
    default = ChurnSimulation(_scheduler(2, 4), arrivals, until=t + 50, queue=True)
    a, b = naive.run(), default.run()
    assert b.max_queue > 5  # the queue was long enough for skipping to matter
    assert b.decisions < a.decisions
    assert naive.timeline == default.timeline
    assert (a.placed, a.completed, a.mean_wait_seconds) == (b.placed, b.completed, b.mean_wait_seconds)


def test_waits_are_reported_per_request_class_with_what_is_still_queued() -> None:
    # One 2-card node. A whole card runs 0–100; a 2-card request arriving at 1 waits until 100 (placed at the tick
    # at 100: waits 99 s); a share arriving at 2 fits beside the whole card at once; a second 2-card request at 3
    # waits behind and is still queued at the end (t = 150: 147 s so far).
    arrivals = [
        Arrival(0.0, _gpu("w", 1000), 100.0),
        Arrival(1.0, Request("m1", num_gpu=2, gpu_milli=1000), 100.0),
        Arrival(2.0, _gpu("s", 500), 10.0),
        Arrival(3.0, Request("m2", num_gpu=2, gpu_milli=1000), 100.0),
    ]
    report = ChurnSimulation(_scheduler(2), arrivals, until=150.0, queue=True, period=5.0).run()
    multi = report.waits["multi-card"]
    assert (multi.started, multi.mean, multi.p95, multi.queued_at_end, multi.longest_queued) == (
        1,
        99.0,
        99.0,
        1,
        147.0,
    )
    # Counting the queued one at its wait so far: (99 + 147) / 2, and the longer of the two at the 95th percentile.
    assert (multi.mean_with_queued, multi.p95_with_queued) == (123.0, 147.0)
    assert report.waits["share"].mean == 0.0 and report.waits["one card"].started == 1
    assert report.waits["share"].p95_with_queued == 0.0
    assert "cpu only" not in report.waits
    assert report.as_dict()["waits_by_class"]["multi-card"]["queued_at_end"] == 1  # type: ignore[index]
    late = ChurnSimulation(_scheduler(2), arrivals, until=150.0, queue=True, period=5.0, warmup=2.5).run()
    assert set(late.waits) == {"multi-card"} and late.waits["multi-card"].started == 0  # arrivals before the window
