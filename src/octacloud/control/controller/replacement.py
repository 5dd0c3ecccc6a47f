"""Make-before-break: a replica replaced by another (a defragmentation move, or one step of a rolling update)
without its deployment ever having fewer replicas that serve, as one state machine with one owner.

A *surge* replica (``replaces`` names the old one, the *source*) is placed and started while the source keeps
serving. Once the surge replica is READY it is routed, the source is retired (drained, then stopped), and
whatever waited for the source's slice (``after``) may start. If the surge replica fails before it is READY, the
replacement is undone: it is stopped and its slice released; for a move, the source takes its own slice back and
what was placed there returns to pending. The source never stops serving before its replacement does::

    STARTING ──ready──▶ ROUTING ──routed──▶ DRAINING ──stopped──▶ RELEASING ──released──▶ DONE
        │                  └───────────── source gone ────────────────────────────────▶ DONE
        └──failed──▶ UNDONE

A replacement in flight is a :class:`~octacloud.control.transitions.Transition` in the store, stored with its surge
replica and again as it enters each phase, so that a restarted controller resumes it (:func:`plan_resume`: carry
it on from its phase when the surge replica is READY or the source no longer runs, undo it when the source still
serves and the surge replica does not). The surge replica stays pinned until the source is gone.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from octacloud.control.controller.contracts import ControllerSettings, Wakeup, log
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, Replica, ReplicaState, new_replica_id
from octacloud.control.transitions import PHASES, Phase, Transition
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Placement
from octacloud.observability.scheduling import SchedulingStats


class Event(enum.StrEnum):
    """What happens to a replacement."""

    READY = "its surge replica is ready"
    FAILED = "its surge replica failed before it was ready"
    ROUTED = "its surge replica is routed to; the source is retired"
    STOPPED = "the source has stopped"
    RELEASED = "the source's record and slice are released"
    SOURCE_GONE = "the source no longer exists"
    # what a restarted controller finds (:func:`plan_resume`)
    ABANDONED = "at a restart: nothing is left to take over, or to take over from"
    NOT_READY_AT_RESTART = "at a restart: the source serves, its replacement does not"
    SOURCE_STOPPED = "at a restart: the source no longer runs"


TRANSITIONS: Mapping[tuple[Phase, Event], Phase] = {
    (Phase.STARTING, Event.READY): Phase.ROUTING,
    (Phase.STARTING, Event.FAILED): Phase.UNDONE,
    (Phase.ROUTING, Event.ROUTED): Phase.DRAINING,
    (Phase.DRAINING, Event.STOPPED): Phase.RELEASING,
    (Phase.RELEASING, Event.RELEASED): Phase.DONE,
    **{(p, Event.SOURCE_GONE): Phase.DONE for p in PHASES},
    **{(p, Event.ABANDONED): Phase.UNDONE for p in PHASES},
    **{(p, Event.NOT_READY_AT_RESTART): Phase.UNDONE for p in PHASES},
    **{(p, Event.SOURCE_STOPPED): Phase.RELEASING for p in PHASES},
}
"""Every move of the machine: (phase, event) → the next phase. Anything else is a bug (:class:`InvalidStep`)."""


class InvalidStep(RuntimeError):
    """An event that cannot happen in a replacement's phase."""


def next_phase(phase: Phase, event: Event) -> Phase:
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise InvalidStep(f"a replacement in phase {phase.value} cannot take the event: {event.value}") from None


class Resume(enum.Enum):
    """What a restarted controller does with a replacement it finds in flight."""

    FORGET = "forget the record"  # ABANDONED
    UNDO = "undo: stop the surge replica, the source serves on"  # NOT_READY_AT_RESTART
    ROUTE = "route the ready surge replica, then retire the source"  # READY, ...
    FINISH = "the source is gone: done"  # SOURCE_GONE
    RELEASE = "the source has stopped: release it"  # SOURCE_STOPPED, RELEASED
    DRAIN = "retire the source (again)"  # ROUTED (or already DRAINING)


@dataclass(frozen=True, slots=True)
class Found:
    """What a restarted controller finds of a replacement's two replicas."""

    surge: bool = True
    """The surge replica's record exists."""
    surge_runs: bool = False
    surge_ready: bool = False
    """It is READY and its process runs."""
    routed: bool = False
    """It took over already (it no longer names the source as the replica it replaces)."""
    source: bool = True
    source_runs: bool = False


def plan_resume(phase: Phase, found: Found) -> Resume:
    """What to do with a replacement a restart interrupted in ``phase``: pure, and total over every case."""
    if not found.surge or (not found.source and not found.surge_ready):
        return Resume.FORGET
    if found.source_runs and not found.surge_ready:
        return Resume.UNDO
    if phase is Phase.RELEASING:  # the source had stopped: only its release is left
        return Resume.RELEASE if found.source else Resume.FINISH
    if found.surge_ready and not found.routed:
        return Resume.ROUTE
    if not found.source:
        return Resume.FINISH
    if not found.source_runs:
        return Resume.RELEASE
    return Resume.DRAIN


class Replacements:
    """The one owner of every replacement in flight: it begins them, moves them through the machine as their
    replicas become ready, fail and stop, and resumes them after a restart."""

    def __init__(
        self,
        *,
        store: ControllerStore,
        lifecycle: Lifecycle,
        reservations: Reservations,
        events: EventLog,
        clock: Clock,
        settings: ControllerSettings,
        scheduling: SchedulingStats,
        wakeup: Wakeup,
    ) -> None:
        self.store, self.lifecycle, self.reservations, self.events = store, lifecycle, reservations, events
        self.clock, self.settings, self.scheduling, self.wakeup = clock, settings, scheduling, wakeup
        self.rollout_backoff: dict[str, float] = {}
        """Deployment → when its rolling update may try again after a replacement failed."""
        self._homeless: set[str] = set()
        """Sources whose move failed before what the pass placed on their slice was told (within one pass)."""

    def in_flight(self) -> dict[str, Transition]:
        """The replacements in flight, by surge replica id."""
        return {t.replacement: t for t in self.store.transitions()}

    def _step(self, t: Transition, event: Event) -> Phase:
        """Move ``t`` by ``event``: the new phase is stored before it begins; an ending deletes the record."""
        phase = next_phase(Phase(t.phase), event)
        if phase in PHASES:
            self.store.put_transition(dataclasses.replace(t, phase=phase))
            t.phase = phase
        else:
            self.store.delete_transition(t.replacement)
        return phase

    def _find(self, deployment: str, replica_id: str) -> Replica | None:
        return next((r for r in self.store.replicas(deployment) if r.id == replica_id), None)

    # ---- beginning ---------------------------------------------------------------------------------------

    def may_roll_out(self, deployment: str) -> bool:
        return self.clock.monotonic() >= self.rollout_backoff.get(deployment, 0.0)

    def begin_update(self, d: Deployment, source: Replica, revision: int, left: int) -> None:
        """One step of ``d``'s rolling update: a surge replica of ``revision`` to replace ``source`` (the next pass
        places it)."""
        model, version, octants = d.template()
        surge = Replica(id=new_replica_id(d.spec.name), deployment=d.spec.name, model=model, version=version,
                        octants=octants, revision=revision, replaces=source.id)  # fmt: skip
        self.store.begin_replacement(surge, Transition(surge.id, source.id, "update", d.spec.name))
        self.events.record(
            "rollout", surge.id, f"revision {revision}: replacing {source.id} ({left} to go)", d.spec.name
        )

    async def begin_move(self, mover: Replica, destination: Placement, d: Deployment) -> None:
        """The pass moved running ``mover`` to ``destination`` in the scheduler's state: start its surge replica
        there (the mover keeps serving from its own slice, which the pass gave to what it placed there)."""
        model, version, octants = mover.runs(d)
        surge = Replica(id=new_replica_id(d.spec.name), deployment=d.spec.name, node=destination.node,
                        gpus=destination.gpus, milli_per_gpu=destination.milli_per_gpu, model=model, version=version,
                        octants=octants, revision=mover.revision, replaces=mover.id)  # fmt: skip
        t = Transition(surge.id, mover.id, "move", d.spec.name, Phase.STARTING, destination.node, destination.gpus,
                       destination.milli_per_gpu)  # fmt: skip
        self.reservations.release(mover.id)
        self.reservations.commit(dataclasses.replace(self.reservations.request(surge, d), pinned=True),
                                 surge.placement())  # fmt: skip
        self.store.begin_replacement(surge, t)  # a restart from here on finds the move and resumes or undoes it
        where = f"{destination.node} cards {list(destination.gpus)}"
        self.events.replica("moving", mover, f"to {where} as {surge.id}: make-before-break")
        why = await self.lifecycle.launch(surge, d)
        if why:
            self.failed(surge, why)

    # ---- the surge replica is ready, or failed -----------------------------------------------------------

    def ready(self, surge: Replica) -> None:
        """``surge`` is READY: route to it and retire the source (``surge`` stays pinned until that is gone)."""
        t = self.store.transition(surge.id)
        source = surge.replaces or (t.source if t is not None else "")
        old = self._find(surge.deployment, source)
        if t is None:  # from before replacements were recorded
            kind = "update" if old is not None and self.reservations.holds(old.id) else "move"
            t = Transition(surge.id, source, kind, surge.deployment)
        if t.phase == Phase.STARTING:
            self._step(t, Event.READY)
        surge.replaces = ""
        self.store.put_replica(surge)
        self.lifecycle.route(surge.deployment)
        if old is None:
            self._finish(t)
        elif t.kind == "move":
            self.scheduling.moved()
            self.events.replica("moved", old, f"{old.node} cards {list(old.gpus)} → {surge.id} on {surge.node}")
            self._retire_source(t, old, f"moved to {surge.id}")
        else:
            self.events.replica("updated", old, f"replaced by {surge.id} (revision {surge.revision})")
            self._retire_source(t, old, f"replaced by {surge.id} in a rolling update")

    def _retire_source(self, t: Transition, old: Replica, why: str) -> None:
        if t.phase == Phase.STARTING:  # (a record from before surge replicas were cleared when routed)
            self._step(t, Event.READY)
        if t.phase == Phase.ROUTING:
            self._step(t, Event.ROUTED)
        self.lifecycle.retire(old, why, on_stopped=lambda stopped: self._source_stopped(t, stopped))

    def _source_stopped(self, t: Transition, old: Replica) -> None:
        self._step(t, Event.STOPPED)
        self._release_source(t, old)

    def _release_source(self, t: Transition, old: Replica) -> None:
        self.lifecycle.release_stopped(old)
        self._step(t, Event.RELEASED)
        self.reservations.pin(t.replacement, pinned=False)

    def _finish(self, t: Transition) -> None:
        self._step(t, Event.SOURCE_GONE)
        self.reservations.pin(t.replacement, pinned=False)

    def failed(self, surge: Replica, why: str) -> None:
        """``surge`` failed before it was READY: undo its replacement; the source keeps serving."""
        if surge.handle:
            self.lifecycle.kill(surge.handle)
        self.reservations.release(surge.id)
        t = self.store.transition(surge.id)
        if t is not None:
            self._step(t, Event.FAILED)
        self.store.delete_replica(surge.id)
        old = self._find(surge.deployment, surge.replaces)
        move = t.kind == "move" if t is not None else old is not None and not self.reservations.holds(old.id)
        if old is not None and move and old.placed:  # a move: the source takes its slice back
            self._unplace_waiters(old.id, f"the move that made room for it was rolled back: {why}")
            if not self.rehome(old.id):
                self._homeless.add(old.id)  # what the pass placed on its slice is told next, and gives it back
            self.events.replica("move rolled back", old, f"{surge.id} failed ({why}); {old.id} keeps serving")
        else:
            delay = self.settings.backoff_max_s
            self.rollout_backoff[surge.deployment] = self.clock.monotonic() + delay
            what = f"{why}; the old replica keeps serving; retry in {delay:g} s"
            self.events.record("rollout failed", surge.id, what, surge.deployment)
        self.wakeup.poke()

    def _unplace_waiters(self, source: str, why: str) -> None:
        """What was placed on ``source``'s slice goes back to pending (the slice is the source's again)."""
        for waiter in self.store.waiting_for(source):
            self.reservations.release(waiter.id)
            waiter.unplace(why)
            self.store.put_replica(waiter)

    # ---- a move that failed within one pass --------------------------------------------------------------

    def new_pass(self) -> None:
        self._homeless.clear()

    def homeless(self, sources: Iterable[str]) -> bool:
        """Whether a move out of one of ``sources`` failed in this pass and its source wants its slice back."""
        return any(s in self._homeless for s in sources)

    def rehome(self, replica_id: str) -> bool:
        """Give a replica whose move failed its own slice back in the scheduler's state; False if it is taken."""
        old = next((r for r in self.store.replicas() if r.id == replica_id), None)
        if old is None or self.reservations.holds(old.id):
            self._homeless.discard(replica_id)
            return True
        try:
            self.reservations.reserve(old, self.store.get_deployment(old.deployment))
        except (InvalidSpecError, NotFoundError) as exc:
            log.info("replica %s: its slice is still taken after a failed move (%s)", old.id, exc)
            return False
        self._homeless.discard(replica_id)
        return True

    # ---- after a restart ---------------------------------------------------------------------------------

    def sort_out(self) -> list[tuple[Transition, Resume]]:
        """Decide what becomes of each replacement a restart interrupted: the undone and the forgotten are dealt
        with here; the others are returned to be carried on (:meth:`carry_on`) once the replicas that still run
        hold their slices again."""
        replicas = {r.id: r for r in self.store.replicas()}
        carry_on: list[tuple[Transition, Resume]] = []
        for t in self.store.transitions():
            surge, old = replicas.get(t.replacement), replicas.get(t.source)
            surge_runs = self.lifecycle.runs(surge)
            found = Found(
                surge=surge is not None,
                surge_runs=surge_runs,
                surge_ready=surge is not None and surge_runs and surge.state is ReplicaState.READY,
                routed=surge is not None and not surge.replaces,
                source=old is not None,
                source_runs=self.lifecycle.runs(old),
            )
            plan = plan_resume(Phase(t.phase), found)
            if plan is Resume.FORGET:
                self._step(t, Event.ABANDONED)
            elif plan is Resume.UNDO:
                assert surge is not None and old is not None
                self._undo_at_restart(t, surge, old, found)
            else:
                carry_on.append((t, plan))
        return carry_on

    def _undo_at_restart(self, t: Transition, surge: Replica, old: Replica, found: Found) -> None:
        if found.surge_runs:
            self.lifecycle.kill(surge.handle)
        self._step(t, Event.NOT_READY_AT_RESTART)
        self.store.delete_replica(surge.id)
        if old.state is ReplicaState.STOPPING:  # it was draining for a replacement that no longer runs
            old.state = ReplicaState.READY
            self.store.put_replica(old)
        if t.kind == "move":
            for waiter in self.store.replicas():
                if old.id in waiter.after:
                    waiter.unplace("the move that made room for it was interrupted by a restart")
                    self.store.put_replica(waiter)
            self.events.replica("move rolled back", old, f"{surge.id} was not ready at restart; {old.id} serves on")
        else:
            self.events.record("rollout failed", surge.id, f"not ready at restart; {old.id} serves on", t.deployment)

    def carry_on(self, t: Transition, plan: Resume) -> None:
        """Finish replacement ``t`` from the phase it had reached, as :meth:`sort_out` planned."""
        replicas = {r.id: r for r in self.store.replicas(t.deployment)}
        surge, old = replicas.get(t.replacement), replicas.get(t.source)
        if surge is None:
            self._step(t, Event.ABANDONED)
            return
        if plan is Resume.ROUTE:
            self.ready(surge)
            return
        if surge.replaces:  # neither serves any longer: the surge replica restarts as an ordinary replica
            surge.replaces = ""
            self.store.put_replica(surge)
        self.lifecycle.route(t.deployment)
        self.reservations.pin(surge.id)
        if old is None:
            self._finish(t)
        elif plan is Resume.RELEASE:
            self._step(t, Event.SOURCE_STOPPED)
            self._release_source(t, old)
            self.events.replica("stopped", old, f"replaced by {surge.id} (finished after a restart)")
        else:
            self._retire_source(t, old, f"replaced by {surge.id} (carried on after a restart)")
