"""One loop, two worlds: the cloud's controller and the simulator's churn mode, fed the same snapshot, decide the
same operations (both run the scheduler's ReevaluationLoop; neither re-implements it)."""

from __future__ import annotations

from pathlib import Path

from octacloud.scheduler.actions.defragment import Move
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.loop import Evict, LoopSettings, PassOperation, ReevaluationLoop, Start
from octacloud.scheduler.policies import build_profile
from octacloud.sim.churn import ChurnSimulation, Pending
from octacloud.sim.reevaluate import LoopHook

from .controller_fakes import Harness
from .test_controller import fragment


def _key(op: PassOperation) -> tuple[object, ...]:
    if isinstance(op, Move):
        return ("move", op.request.name, op.source, op.destination)
    if isinstance(op, Evict):
        return ("evict", op.victim.request.name, op.by)
    assert isinstance(op, Start)
    return ("start", op.request.name, op.placement, op.after)


async def test_controller_and_simulator_decide_the_same_on_one_snapshot(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    h.deploy("big", octants=8)
    h.deploy("vip", octants=8, priority=10)
    # the snapshot: what runs, and what waits (the controller would hand exactly these to its pass)
    state = h.controller.scheduler.state
    running = [(a.request, a.placement) for a in state]
    await h.controller.reconcile()  # creates the pending replicas and runs the pass
    cloud = h.controller.executor.last
    assert cloud is not None
    pending = [r for r in h.store.replicas() if r.deployment in ("big", "vip")]
    requests = {r.id: h.controller.reservations.request(r, h.store.get_deployment(r.deployment)) for r in pending}

    sim_state = ClusterState(h.nodes)
    scheduler = Scheduler(sim_state, build_profile("bestfit", seed=0))
    hook = LoopHook(ReevaluationLoop(scheduler))
    sim = ChurnSimulation(scheduler, [], until=100.0, queue=True, hooks=[hook])
    for request, placement in running:
        scheduler.commit(request, placement)
        sim.start_placed(request, 1000.0, since=0.0)
    order = [r.name for r in cloud.pending] + [op.request.name for op in cloud.operations if isinstance(op, Start)]
    for name in sorted(requests, key=order.index):  # the controller's order (priority first, as the pass sorts)
        sim.pending.append(Pending(requests[name], 100.0, 0.0))
    hook(sim)
    assert hook.last is not None
    decided = [_key(op) for op in cloud.operations]
    assert decided == [_key(op) for op in hook.last.operations]
    kinds = {k[0] for k in decided}
    assert {"evict", "start"} <= kinds or {"move", "start"} <= kinds  # the snapshot makes the pass do real work
    held = [(res.request.name, res.node, res.cards) for res in cloud.reservations]
    assert held == [(res.request.name, res.node, res.cards) for res in hook.last.reservations]


async def test_controller_and_simulator_hold_the_same_reservation_and_admit_the_same(tmp_path: Path) -> None:
    """A replica that fits nowhere (defragmentation off) reserves the same node in both worlds, and a later
    request of no higher priority is refused the reserved card by both (the simulator's arrival admission is the
    loop's, the controller's next pass is the loop's)."""
    h = Harness(tmp_path)
    h.controller.loop.settings = LoopSettings(defragment=False, preempt=False)
    await fragment(h)
    state = h.controller.scheduler.state
    running = [(a.request, a.placement) for a in state]
    h.deploy("big", octants=8)
    await h.reconcile()
    cloud = h.controller.executor.last
    assert cloud is not None and cloud.placed == {}
    (big,) = h.replicas("big")
    request = h.controller.reservations.request(big, h.store.get_deployment("big"))

    sim_state = ClusterState(h.nodes)
    scheduler = Scheduler(sim_state, build_profile("bestfit", seed=0))
    hook = LoopHook(ReevaluationLoop(scheduler, LoopSettings(defragment=False, preempt=False)))
    sim = ChurnSimulation(scheduler, [], until=100.0, queue=True, hooks=[hook], admission=hook.loop.admit)
    for r, placement in running:
        scheduler.commit(r, placement)
        sim.start_placed(r, 1000.0, since=0.0)
    sim.pending.append(Pending(request, 100.0, 0.0))
    hook(sim)
    assert hook.last is not None
    held = [(res.request.name, res.node, res.cards) for res in cloud.reservations]
    assert held and held == [(res.request.name, res.node, res.cards) for res in hook.last.reservations]
    node, cards = held[0][1], held[0][2]
    # the half card left free on the reserved node is the holder's: neither world gives it to a later share
    h.deploy("late", octants=4)
    await h.reconcile()
    (late,) = h.replicas("late")
    late_request = h.controller.reservations.request(late, h.store.get_deployment("late"))
    sim_decision = hook.loop.admit(late_request)
    cloud_node = late.node if late.placed else None
    sim_node = sim_decision.placement.node if sim_decision.placement is not None else None
    assert cloud_node == sim_node and cloud_node is not None and cloud_node != h.nodes[node].name
    assert sim_node is None or (h.nodes[node].name, cards) != (sim_node, sim_decision.placement.gpus)  # type: ignore[union-attr]
