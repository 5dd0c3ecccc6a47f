"""Churn mode driven by the scheduler's loop: defragmentation places what plain retries cannot, strands nothing."""

from __future__ import annotations

from collections import Counter

from octacloud.core.clock import ManualClock
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.scheduler.policies import build_profile
from octacloud.sim.churn import ChurnReport, ChurnSimulation
from octacloud.sim.reevaluate import LoopHook
from octacloud.sim.synthetic import Arrival
from tests.scheduler.helpers import check_invariants, node, place, req


def _run(defrag: bool) -> tuple[ChurnReport, ChurnSimulation, LoopHook | None]:
    # Two 2-card nodes, each with one card half used and one full: 1 000 milli free, but no whole card.
    state = ClusterState([node("a"), node("b")])
    for name, milli, where, card in (("x", 500, "a", 0), ("y", 500, "b", 0), ("u", 1000, "a", 1), ("v", 1000, "b", 1)):
        place(state, req(name, milli), where, (card,))
    scheduler = Scheduler(state, build_profile("bestfit", seed=5))
    arrivals = [Arrival(1.0, req("p", 1000), 100.0), Arrival(2.0, req("s", 250), 10.0)]
    hook = LoopHook(ReevaluationLoop(scheduler, LoopSettings(period=5.0, moves_per_pass=4))) if defrag else None
    sim = ChurnSimulation(
        scheduler, arrivals, until=200.0, clock=ManualClock(), queue=True, period=5.0, hooks=[hook] if hook else None
    )
    return sim.run(), sim, hook


def test_defragmentation_raises_time_averaged_allocation() -> None:
    plain, _, _ = _run(defrag=False)
    report, sim, hook = _run(defrag=True)
    assert plain.queued_at_end == 1  # the whole-card request never fits without moving anything
    assert report.queued_at_end == 0 and report.completed == 2
    assert hook is not None and hook.moves == 1 and hook.moved_gpu_milli == 500
    assert report.time_avg_allocated_pct > plain.time_avg_allocated_pct
    # 's' (250) fits at once, on a half-used card: until it departs (t=12) no plan can free a whole card (the
    # other half-used card has no room for both shares), so 'p' starts at the first pass after, t=15: waits 14.
    assert report.mean_wait_seconds == (0.0 + 14.0) / 2
    check_invariants(sim.state)


def test_no_replica_is_stranded_by_moves() -> None:
    _, sim, hook = _run(defrag=True)
    assert hook is not None and hook.moves == 1
    names = Counter(a.request.name for a in sim.state)
    assert names == Counter({"x": 1, "y": 1, "u": 1, "v": 1})  # 'p' and 's' departed; the moved share is still there
    assert sim.state.allocated_gpu_milli == 3000
