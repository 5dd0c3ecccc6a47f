"""A controller killed in the middle of a make-before-break replacement (a move or a rolling-update step), then
started again over the same store while the replicas live on: it carries the replacement on from the phase it
had recorded when the replacement is READY, and rolls it back when not; never two replicas serving for one at
the end, never none meanwhile, and every slice reserved is a slice used."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Replica, ReplicaState
from octacloud.control.launcher import Launched, LaunchSpec
from octacloud.control.transitions import Transition

from .controller_fakes import Harness


class Killed(BaseException):
    """The controller's process died here (a BaseException: no ``except Exception`` in the controller stops it)."""


class KillAt(ControllerStore):
    """A store that kills the controller when a replacement's phase is recorded (``before`` or ``after`` it is)."""

    point: tuple[str, str] | None = None
    killed = False

    def _kill(self, phase: str, when: str) -> None:
        if self.point == (phase, when):
            self.point, self.killed = None, True
            raise Killed(f"{when} {phase}")

    def begin_replacement(self, surge: Replica, t: Transition) -> None:
        self._kill(t.phase, "before")
        super().begin_replacement(surge, t)
        self._kill(t.phase, "after")

    def put_transition(self, t: Transition) -> None:
        self._kill(t.phase, "before")
        super().put_transition(t)
        self._kill(t.phase, "after")


POINTS = [
    ("starting", "before"),  # nothing recorded yet: the surge replica does not exist
    ("starting", "after"),  # recorded, not launched
    None,  # launched, not ready yet
    ("routing", "before"),  # READY, not routed
    ("routing", "after"),
    ("draining", "before"),  # routed, the old replica not yet retired
    ("draining", "after"),
    ("releasing", "before"),  # the old replica stopped, that not yet recorded
    ("releasing", "after"),  # the old replica stopped, its record and slice not yet released
]
ROLLED_BACK = {("starting", "after"), None}


def check_invariants(h: Harness) -> None:
    replicas = h.replicas()
    state = h.controller.scheduler.state
    assert {a.request.name for a in state} == {r.id for r in replicas if r.placed}  # reserved = used
    assert h.launcher.ids() == {r.id for r in replicas}  # nothing runs that is not recorded, nor the reverse
    for d in h.store.deployments():
        mine = h.replicas(d.spec.name)
        assert len(mine) == d.replicas and all(r.state is ReplicaState.READY and not r.replaces for r in mine)
        assert sorted(h.routed(d.spec.name)) == sorted(r.id for r in mine)
    assert h.store.transitions() == [] and h.controller.replacements.in_flight() == {}
    assert not any(a.request.pinned for a in state)


async def kill_and_restart(h: Harness, point: tuple[str, str] | None) -> Transition | None:
    """Run the controller until ``point`` kills it (None: once the replacement is launched), then start a new one
    over the same store and replicas."""
    assert isinstance(h.store, KillAt)
    h.store.point = point
    try:
        await h.reconcile()
        for _ in range(3 if point is not None else 0):
            if h.store.killed:
                break
            await h.health()
    except Killed:
        pass
    await h.settle()
    assert h.store.killed == (point is not None)
    return await _restart(h)


PINNED_AT_ADOPTION: set[str] = set()


async def _restart(h: Harness) -> Transition | None:
    recorded = h.store.transitions()
    h.routes.routes.clear()  # the gateway died with it (single-process mode)
    h.controller = h.make()
    h.controller.adopt()
    PINNED_AT_ADOPTION.clear()
    PINNED_AT_ADOPTION.update(a.request.name for a in h.controller.scheduler.state if a.request.pinned)
    await h.settle()
    return recorded[0] if recorded else None


async def fragment(h: Harness) -> None:
    for name in ("a1", "a2", "b1", "b2"):
        h.deploy(name, octants=4)
        await h.reconcile()
    await h.health()
    h.controller.undeploy("a1")
    h.controller.undeploy("b1")
    await h.settle()


@pytest.mark.parametrize("point", POINTS, ids=lambda p: "-".join(p) if p else "launched")
async def test_a_restart_at_each_phase_of_a_move(tmp_path: Path, point: tuple[str, str] | None) -> None:
    h = Harness(tmp_path)
    h.wrap = KillAt
    h.controller = h.make()
    await fragment(h)
    serving = {r.deployment: r.id for r in h.replicas()}
    h.deploy("big", octants=8)
    t = await kill_and_restart(h, point)
    if point == ("starting", "before"):
        assert t is None and not any(r.replaces for r in h.replicas())
    else:
        assert t is not None and t.kind == "move"
        routed = h.routed(t.deployment)
        assert len(routed) == 1  # one serves for the deployment at once: never none, never two
        rolled_back = point in ROLLED_BACK
        assert routed == ([t.source] if rolled_back else [t.replacement])
        if rolled_back:
            assert t.replacement not in h.launcher.ids() and h.events("move rolled back")
            assert t.source in h.controller.scheduler.state.allocations  # the old one has its slice back
            assert h.replicas("big")[0].placed is False  # what waited for that slice waits to be placed again
        else:
            assert h.controller.reservations.holds(t.replacement)
            # the move's target is not moved again before it is done (a move whose source had stopped, recorded as
            # releasing or not yet, is done at adoption)
            assert point is not None
            assert (t.replacement in PINNED_AT_ADOPTION) == (point[0] != "releasing")
            assert t.source not in h.controller.scheduler.state.allocations  # its slice is big's already
    for _ in range(6):
        await h.reconcile()
        await h.health()
        for deployment in serving:
            if deployment in {"a2", "b2"}:
                assert len(h.routed(deployment)) == 1
    check_invariants(h)
    assert h.ready("big")
    assert len(h.events("moved")) == 1  # done once (again, if it was rolled back), never counted twice


@pytest.mark.parametrize("point", POINTS, ids=lambda p: "-".join(p) if p else "launched")
async def test_a_restart_at_each_phase_of_a_rolling_update(tmp_path: Path, point: tuple[str, str] | None) -> None:
    h = Harness(tmp_path)
    h.wrap = KillAt
    h.controller = h.make()
    h.deploy("a", octants=2)
    await h.reconcile()
    await h.health()
    (first,) = h.replicas("a")
    h.deploy("a", octants=2, version="2")
    t = await kill_and_restart(h, point)
    if point == ("starting", "before"):
        assert t is None
    else:
        assert t is not None and t.kind == "update" and t.source == first.id
        rolled_back = point in ROLLED_BACK
        assert h.routed("a") == ([first.id] if rolled_back else [t.replacement])
        if rolled_back:
            assert t.replacement not in h.launcher.ids() and h.events("rollout failed")
    for _ in range(4):
        await h.reconcile()
        await h.health()
        assert len(h.routed("a")) == 1
        h.clock.advance(h.controller.settings.backoff_max_s)  # past a rolled-back rollout's back-off
    check_invariants(h)
    (done,) = h.replicas("a")
    assert done.version == "2" and first.id not in h.launcher.ids()


async def test_undeploying_in_the_middle_of_a_rolling_update_leaves_no_replacement_behind(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2)
    await h.reconcile()
    await h.health()
    h.deploy("a", octants=2, version="2")
    await h.reconcile()
    assert h.store.transitions()
    h.controller.undeploy("a")
    await h.settle()
    assert h.replicas() == [] and h.store.transitions() == [] and h.controller.replacements.in_flight() == {}
    assert h.launcher.ids() == set() and not list(h.controller.scheduler.state)


async def test_a_replica_launched_just_before_the_controller_died_is_stopped_at_restart(tmp_path: Path) -> None:
    """The launch returned, the controller died before the store had the replica's handle: the process runs and
    no record names it. The next controller finds it through the launcher and stops it, then starts the replica
    as usual: one process per replica, none unaccounted for."""
    h = Harness(tmp_path)
    h.wrap = KillAt
    h.controller = h.make()
    h.deploy("a", octants=4)
    await h.reconcile()
    await h.health()
    assert h.ready("a")
    real = h.launcher.launch

    def dying(spec: LaunchSpec) -> Launched:
        real(spec)  # the process is started
        raise Killed("after the launch, before its handle is stored")

    h.launcher.launch = dying  # type: ignore[method-assign]
    h.deploy("late", octants=2)
    with pytest.raises(Killed):
        await h.reconcile()  # places and launches "late"
    stray = [handle for handle, spec in h.launcher.running.items() if spec.serve_as == "late"]
    assert len(stray) == 1 and not any(r.handle == stray[0] for r in h.replicas())
    h.launcher.launch = real  # type: ignore[method-assign]
    await _restart(h)
    for _ in range(4):
        await h.reconcile()
        await h.health()
    await h.settle()
    assert stray[0] not in h.launcher.running and h.events("stray replica stopped")
    check_invariants(h)
    assert h.ready("late")
