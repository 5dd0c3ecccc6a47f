"""The loop's queue discipline in churn mode: arrivals go through the loop's admission, so a reservation holds."""

from __future__ import annotations

from octacloud.core.clock import ManualClock
from octacloud.core.model import Request
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.sim.churn import ChurnSimulation
from octacloud.sim.reevaluate import LoopHook
from octacloud.sim.synthetic import Arrival

from .test_churn import _scheduler


def _arrivals() -> list[Arrival]:
    """Two one-card jobs fill a two-card node; a two-card job arrives; then a one-card job every second, each
    running 9 s: without a reservation an arrival (or, at a pass, an older one-card job) always takes the card
    that a departure frees, so the two cards are never free together."""
    out = [
        Arrival(0.0, Request("a", num_gpu=1, gpu_milli=1000), 9.0),
        Arrival(1.0, Request("b", num_gpu=1, gpu_milli=1000), 9.0),
        Arrival(2.0, Request("big", num_gpu=2, gpu_milli=1000), 5.0),
    ]
    out += [Arrival(2.5 + k, Request(f"s{k}", num_gpu=1, gpu_milli=1000), 9.0) for k in range(80)]
    return out


def _run(reservations: int) -> tuple[ChurnSimulation, LoopHook]:
    scheduler = _scheduler(2)
    hook = LoopHook(ReevaluationLoop(scheduler, LoopSettings(reservations=reservations, defragment=False)))
    sim = ChurnSimulation(
        scheduler,
        _arrivals(),
        until=90.0,
        clock=ManualClock(),
        queue=True,
        hooks=[hook],
        admission=hook.loop.admit,
    )
    sim.run()
    return sim, hook


def test_without_a_reservation_the_two_card_job_starves() -> None:
    sim, _hook = _run(0)
    assert "big" in {p.request.name for p in sim.pending}


def test_with_a_reservation_the_two_card_job_starts_and_arrivals_wait_behind_it() -> None:
    sim, hook = _run(1)
    assert "big" not in {p.request.name for p in sim.pending}
    report = sim._report()
    assert report.waits["multi-card"].started == 1 and report.waits["multi-card"].max <= 15.0
    assert hook.loop.reserved == {} or "big" not in hook.loop.reserved
    assert sim.state.allocated_gpu_milli <= sim.state.total_gpu_milli
