"""The loop's queue discipline in churn mode: arrivals go through the loop's admission, so a reservation holds."""

from __future__ import annotations

import pytest

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


def _run(
    reservations: int, serve: bool = True, arrivals: list[Arrival] | None = None, cards: int = 2, until: float = 90.0
) -> tuple[ChurnSimulation, LoopHook]:
    scheduler = _scheduler(cards)
    hook = LoopHook(ReevaluationLoop(scheduler, LoopSettings(reservations=reservations, defragment=False)))
    sim = ChurnSimulation(
        scheduler,
        _arrivals() if arrivals is None else arrivals,
        until=until,
        clock=ManualClock(),
        queue=True,
        hooks=[hook],
        admission=hook.loop.admit,
        on_release=hook.released if serve else None,
    )
    sim.run()
    return sim, hook


@pytest.mark.parametrize("serve", [False, True])
def test_without_a_reservation_the_two_card_job_starves(serve: bool) -> None:
    sim, _hook = _run(0, serve)
    assert "big" in {p.request.name for p in sim.pending}


@pytest.mark.parametrize("serve", [False, True])
def test_with_a_reservation_the_two_card_job_starts_and_arrivals_wait_behind_it(serve: bool) -> None:
    sim, hook = _run(1, serve)
    assert "big" not in {p.request.name for p in sim.pending}
    report = sim._report()
    assert report.waits["multi-card"].started == 1 and report.waits["multi-card"].max <= 15.0
    assert hook.loop.reserved == {} or "big" not in hook.loop.reserved
    assert sim.state.allocated_gpu_milli <= sim.state.total_gpu_milli


def test_a_card_a_departure_frees_goes_to_the_queue_before_a_later_arrival() -> None:
    # One card. "a" runs 0–10.5; "b" arrives at 1 and waits; "c" arrives at 11, before the pass at 15. Served at
    # the release (as a pass woken by it would), b starts at 10.5 and c waits behind it. Left to the next pass,
    # the card idles until then (b's reservation keeps c off it), or, without reservations, the later arrival c
    # takes it and b waits on.
    arrivals = [
        Arrival(0.0, Request("a", num_gpu=1, gpu_milli=1000), 10.5),
        Arrival(1.0, Request("b", num_gpu=1, gpu_milli=1000), 20.0),
        Arrival(11.0, Request("c", num_gpu=1, gpu_milli=1000), 20.0),
    ]
    served, _ = _run(1, True, arrivals, cards=1, until=14.0)
    assert set(served.running) == {"b"} and [p.request.name for p in served.pending] == ["c"]
    assert served._report().waits["one card"].max == 9.5  # b: arrived at 1, started at 10.5
    idle, _ = _run(1, False, arrivals, cards=1, until=14.0)
    assert idle.running == {} and [p.request.name for p in idle.pending] == ["b", "c"]
    later, _ = _run(0, False, arrivals, cards=1, until=14.0)
    assert set(later.running) == {"c"} and [p.request.name for p in later.pending] == ["b"]


def test_a_released_card_on_a_reserved_node_stays_for_its_holder() -> None:
    # Two cards, both busy; "big" (two cards) holds the reservation. When one card frees, the queued one-card
    # request behind it may not take it (it would delay the holder); when the second frees, big starts.
    arrivals = [
        Arrival(0.0, Request("a", num_gpu=1, gpu_milli=1000), 8.0),
        Arrival(0.5, Request("b", num_gpu=1, gpu_milli=1000), 12.0),
        Arrival(1.0, Request("big", num_gpu=2, gpu_milli=1000), 30.0),
        Arrival(2.0, Request("small", num_gpu=1, gpu_milli=1000), 5.0),
    ]
    sim, hook = _run(1, True, arrivals, until=10.0)
    assert set(sim.running) == {"b"} and {p.request.name for p in sim.pending} == {"big", "small"}
    assert "big" in hook.loop.reserved
    sim, _ = _run(1, True, arrivals, until=13.0)
    assert set(sim.running) == {"big"}  # started at 12.5, when b left
