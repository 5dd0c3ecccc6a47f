"""The make-before-break state machine as tables: every move it makes, every move it refuses, and what a restarted
controller does with a replacement it finds in each phase. (The same machine driven by the controller, with a
kill at every phase, is tests/cluster/test_controller_restart.py; with kill -9, test_defrag_kill9.py.)"""

from __future__ import annotations

import itertools

import pytest

from octacloud.control.controller.replacement import (
    TRANSITIONS,
    Event,
    Found,
    InvalidStep,
    Resume,
    next_phase,
    plan_resume,
)
from octacloud.control.transitions import PHASES, Phase

S, R, D, L = Phase.STARTING, Phase.ROUTING, Phase.DRAINING, Phase.RELEASING
LIVE = [S, R, D, L]

MOVES = {
    # the way through: start, ready, switch, drain, stop, release
    (S, Event.READY): R,
    (R, Event.ROUTED): D,
    (D, Event.STOPPED): L,
    (L, Event.RELEASED): Phase.DONE,
    # undo: the surge replica failed before it was ready
    (S, Event.FAILED): Phase.UNDONE,
    # the source went (scaled down, undeployed) before the surge replica took over
    (S, Event.SOURCE_GONE): Phase.DONE,
    (R, Event.SOURCE_GONE): Phase.DONE,
    (D, Event.SOURCE_GONE): Phase.DONE,
    (L, Event.SOURCE_GONE): Phase.DONE,
    # what a restarted controller finds, in any phase
    **{(p, Event.ABANDONED): Phase.UNDONE for p in LIVE},
    **{(p, Event.NOT_READY_AT_RESTART): Phase.UNDONE for p in LIVE},
    **{(p, Event.SOURCE_STOPPED): L for p in LIVE},
}


def test_the_stored_phases_are_the_live_ones_in_order() -> None:
    assert list(PHASES) == LIVE
    assert TRANSITIONS == MOVES


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(LIVE, Event)), ids=str)
def test_every_move_and_every_refusal(phase: Phase, event: Event) -> None:
    if (phase, event) in MOVES:
        assert next_phase(phase, event) is MOVES[(phase, event)]
    else:
        with pytest.raises(InvalidStep, match=phase.value):
            next_phase(phase, event)


@pytest.mark.parametrize("event", list(Event), ids=str)
@pytest.mark.parametrize("end", [Phase.DONE, Phase.UNDONE], ids=str)
def test_an_ended_replacement_takes_no_event(end: Phase, event: Event) -> None:
    with pytest.raises(InvalidStep):
        next_phase(end, event)


def test_a_failure_after_the_switch_is_no_undo() -> None:
    """Once routed to, the surge replica is an ordinary replica: its failure restarts it, the source is going."""
    for phase in (R, D, L):
        with pytest.raises(InvalidStep):
            next_phase(phase, Event.FAILED)


ready = Found(surge_runs=True, surge_ready=True)
CASES = [
    # (phase, what is found, what is done)
    (S, Found(surge=False, source_runs=True), Resume.FORGET),  # nothing to take over to
    (S, Found(source=False), Resume.FORGET),  # nothing to take over from, nothing ready
    (S, Found(source_runs=True), Resume.UNDO),  # placed or launched, not ready: the source serves on
    (S, Found(surge_runs=True, source_runs=True), Resume.UNDO),  # starting, not ready yet: undone all the same
    (S, Found(surge_runs=True, surge_ready=True, source_runs=True), Resume.ROUTE),  # ready, not yet routed
    (S, Found(surge_runs=True, surge_ready=True, source=False), Resume.ROUTE),
    (S, Found(surge_runs=True), Resume.RELEASE),  # neither serves: the source is released, the surge restarts
    (R, Found(surge_runs=True, surge_ready=True, source_runs=True), Resume.ROUTE),  # recorded, not yet cleared
    (R, Found(surge_runs=True, surge_ready=True, routed=True, source_runs=True), Resume.DRAIN),
    (R, Found(surge_runs=True, surge_ready=True, routed=True, source=False), Resume.FINISH),
    (R, Found(routed=True, source_runs=True), Resume.UNDO),  # routed, then died: the source still serves
    (D, Found(surge_runs=True, surge_ready=True, routed=True, source_runs=True), Resume.DRAIN),
    (D, Found(surge_runs=True, surge_ready=True, routed=True), Resume.RELEASE),  # stopped, not yet recorded
    (D, Found(routed=True), Resume.RELEASE),
    (L, Found(surge_runs=True, surge_ready=True, routed=True), Resume.RELEASE),
    (L, Found(surge_runs=True, surge_ready=True, routed=True, source_runs=True), Resume.RELEASE),
    (L, Found(surge_runs=True, surge_ready=True, routed=True, source=False), Resume.FINISH),
    (L, Found(surge=False), Resume.FORGET),
]


@pytest.mark.parametrize(("phase", "found", "plan"), CASES)
def test_resume_after_a_restart(phase: Phase, found: Found, plan: Resume) -> None:
    assert plan_resume(phase, found) is plan


STEPS = {
    Resume.FORGET: [Event.ABANDONED],
    Resume.UNDO: [Event.NOT_READY_AT_RESTART],
    Resume.FINISH: [Event.SOURCE_GONE],
    Resume.RELEASE: [Event.SOURCE_STOPPED, Event.RELEASED],
}


def way_on(phase: Phase, found: Found, plan: Resume) -> list[Event]:
    """The events a resumed replacement goes through from ``phase`` to its end, as the controller takes it."""
    if plan in STEPS:
        return STEPS[plan]
    if plan is Resume.ROUTE and not found.source:
        return ([Event.READY] if phase is S else []) + [Event.SOURCE_GONE]
    return {S: [Event.READY, Event.ROUTED], R: [Event.ROUTED], D: []}[phase] + [Event.STOPPED, Event.RELEASED]


@pytest.mark.parametrize("phase", LIVE, ids=str)
def test_whatever_a_restart_finds_the_replacement_ends(phase: Phase) -> None:
    """Total: in every phase, for every combination of what is found, the plan is a way through the machine."""
    for flags in itertools.product([False, True], repeat=6):
        found = Found(*flags)
        plan = plan_resume(phase, found)
        at = phase
        for event in way_on(phase, found, plan):
            at = next_phase(at, event)
        assert at in (Phase.DONE, Phase.UNDONE), (found, plan)
