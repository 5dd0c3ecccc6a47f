"""The controller with a manual clock, a fake launcher and a fake prober: no processes, no sockets."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from octacloud.control.controller import Probe
from octacloud.control.deployments import DeploymentSpec, Replica, ReplicaState
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Health

from .controller_fakes import Harness, fleet


async def _until(done: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Wait until ``done()`` holds, yielding to the loop; ``limit_s`` only ends a test that would hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not done():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def test_deploy_places_launches_and_routes_once_ready(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2, replicas=2)
    await h.reconcile()
    rs = h.replicas("a")
    assert len(rs) == 2 and all(r.state is ReplicaState.STARTING and r.placed for r in rs)
    assert h.routed("a") == []  # not before it is ready
    await h.health()
    assert sorted(h.routed("a")) == sorted(r.id for r in rs)
    ev = h.events("ready")[0]
    assert ev["deployment"] == "a" and ev["tenant"] == "default"  # events carry their deployment and tenant


async def test_a_crash_restarts_after_the_back_off_at_a_health_tick(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a")
    await h.reconcile()
    await h.health()
    (r,) = h.replicas("a")
    h.launcher.crash(r.id)
    await h.health()
    assert h.replicas("a")[0].state is ReplicaState.FAILED and h.routed("a") == []
    h.clock.advance(0.4)
    await h.health()
    assert h.replicas("a")[0].state is ReplicaState.FAILED  # back-off 0.5 s not over
    h.clock.advance(0.1)
    await h.health()  # no reconcile needed: the health tick restarts it
    again = h.replicas("a")[0]
    assert again.state is ReplicaState.STARTING and again.restarts == 1 and again.node == r.node
    h.launcher.crash(r.id)
    await h.health()
    h.clock.advance(0.5)
    await h.health()
    assert h.replicas("a")[0].state is ReplicaState.FAILED  # second failure: 1 s
    h.clock.advance(0.5)
    await h.health()
    assert h.replicas("a")[0].state is ReplicaState.STARTING


async def test_the_gateway_hears_a_crashed_replica_is_gone_and_a_drained_one_is_not(tmp_path: Path) -> None:
    """A replica whose process exits is dropped from the routes as *gone* (the gateway ends what it has in flight
    there at once, to retry it elsewhere); one scaled away is dropped and drains."""
    h = Harness(tmp_path)
    h.controller.deploy(DeploymentSpec("a", "m", octants=4, min_replicas=1, max_replicas=2))
    h.controller.scale("a", 2)
    await h.reconcile()
    await h.health()
    assert len(h.ready("a")) == 2
    gone: list[str] = []
    dropped: list[str] = []
    h.routes.on_gone.append(lambda e: gone.append(e.replica_id))
    h.routes.on_drop.append(lambda e: dropped.append(e.replica_id))
    h.controller.scale("a", 1)
    await h.controller.reconcile()
    await h.settle()
    (kept,) = h.ready("a")
    assert gone == [] and len(dropped) == 1 and kept.id not in dropped  # the one scaled away drained: not gone
    h.launcher.crash(kept.id)
    await h.health()
    assert gone == [kept.id] and dropped[1:] == [kept.id]


async def test_a_model_that_fails_to_load_fails_at_once_with_an_event(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a")
    await h.reconcile()
    (r,) = h.replicas("a")
    h.prober.answers[r.id] = Probe(False, "onnx: invalid graph")
    await h.health()
    r = h.replicas("a")[0]
    assert r.state is ReplicaState.FAILED and "invalid graph" in r.message
    assert any("invalid graph" in str(e["message"]) for e in h.events("failed"))
    assert h.launcher.ids() == set()  # its process was stopped


async def test_failover_re_places_on_another_node(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a")
    await h.reconcile()
    await h.health()
    (r,) = h.replicas("a")
    h.controller.mark_node(r.node, Health.FAILED)
    await h.settle()
    lost = h.replicas("a")[0]
    assert lost.state is ReplicaState.PENDING and lost.failover and h.routed("a") == []
    await h.reconcile()
    moved = h.replicas("a")[0]
    assert moved.state is ReplicaState.STARTING and moved.node != r.node


async def test_scale_down_stops_the_least_useful_after_draining_then_releases(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(1, 1))
    h.deploy("blocker", octants=4)
    await h.reconcile()
    h.deploy("a", octants=2, replicas=3)  # the third fits nowhere: it stays pending
    h.clock.advance(0.1)
    await h.controller.reconcile()  # both start now; make one of them the newer
    (second,) = [r for r in h.replicas("a") if r.state is ReplicaState.STARTING][1:]
    second.started_at += 1.0
    h.store.put_replica(second)
    await h.health()
    assert sorted(r.state.value for r in h.replicas("a")) == ["pending", "ready", "ready"]
    older, newest = sorted(h.ready("a"), key=lambda r: r.started_at)
    assert older.started_at < newest.started_at
    d = h.store.get_deployment("a")
    d.replicas = 1  # as the autoscaler would
    h.store.put_deployment(d)
    endpoint = next(e for e in h.routes.routes["a"] if e.replica_id == newest.id)
    endpoint.outstanding = 1  # a request in flight
    await h.controller.reconcile()
    states = {r.id: r.state for r in h.replicas("a")}
    assert ReplicaState.PENDING not in states.values()  # the pending one went first
    assert states[newest.id] is ReplicaState.STOPPING and newest.id not in h.routed("a")
    assert newest.id in h.controller.scheduler.state.allocations  # its slice is held while it drains
    await asyncio.sleep(0.1)
    assert newest.id in h.launcher.ids()  # still draining
    endpoint.outstanding = 0
    await h.settle()
    assert [r.id for r in h.replicas("a")] == [r.id for r in h.ready("a")] and len(h.ready("a")) == 1
    assert newest.id not in h.controller.scheduler.state.allocations
    assert h.launcher.stopped[-1][1] == h.controller.settings.stop_grace_s  # SIGTERM, then SIGKILL after grace


async def test_autoscaling_follows_measured_load(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.controller.deploy(DeploymentSpec("a", "m", octants=1, min_replicas=1, max_replicas=4, target_qps=10.0))
    await h.reconcile()
    await h.health()
    counter = h.routes.counter("a")
    for _ in range(6):
        h.clock.advance(5.0)
        counter.requests += 500  # 100 req/s against a capacity of 10 per replica
        counter.latency_us_total += 500 * 1000
        await h.reconcile()
        await h.health()
    assert h.store.get_deployment("a").replicas > 1 and h.events("autoscale")


async def test_adoption_after_a_controller_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", replicas=2, octants=2)
    await h.reconcile()
    await h.health()
    alive, dead = h.replicas("a")
    h.launcher.crash(dead.id)
    h.routes.routes.clear()
    h.controller = h.make()  # a new controller on the same store and fleet
    h.controller.adopt()
    assert h.routed("a") == [alive.id]
    assert {r.id: r.state for r in h.replicas("a")}[dead.id] is ReplicaState.FAILED
    assert alive.id in h.controller.scheduler.state.allocations and dead.id in h.controller.scheduler.state.allocations


async def fragment(h: Harness) -> None:
    """Two cards of 8 octants, each left with 4 free in a different place: an 8-octant replica fits nowhere."""
    for name in ("a1", "a2", "b1", "b2"):
        h.deploy(name, octants=4)
        await h.reconcile()
    await h.health()
    cards = {r.deployment: r.node for r in h.replicas()}
    assert cards["a1"] == cards["a2"] != cards["b1"] == cards["b2"]
    h.controller.undeploy("a1")
    h.controller.undeploy("b1")
    await h.settle()


async def test_a_move_is_make_before_break(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    h.deploy("big", octants=8)
    await h.reconcile()
    surges = [r for r in h.replicas() if r.replaces]
    assert len(surges) == 1
    surge = surges[0]
    old = next(r for r in h.replicas() if r.id == surge.replaces)
    big = h.replicas("big")[0]
    assert big.state is ReplicaState.PENDING and big.placed and big.after == [old.id]  # waits for the old one
    assert h.routed(old.deployment) == [old.id]  # the old one serves until its successor does
    assert not h.events("moved")
    await h.health()  # the surge is ready: it takes over, the old one drains and stops
    assert h.routed(old.deployment) == [surge.id] and old.id not in h.launcher.ids()
    assert h.controller.scheduling.defragmentation_moves == 1 and h.events("moved")
    await h.health()  # the room is free: the big one starts
    assert h.replicas("big")[0].state is ReplicaState.STARTING
    await h.health()
    assert h.ready("big")


async def test_a_failed_move_rolls_back_and_the_old_replica_keeps_serving(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    h.deploy("big", octants=8)
    await h.reconcile()
    surge = next(r for r in h.replicas() if r.replaces)
    h.prober.answers[surge.id] = Probe(False, "out of memory")
    await h.health()
    old = next(r for r in h.replicas() if r.id == surge.replaces)
    assert old.state is ReplicaState.READY and h.routed(old.deployment) == [old.id]
    assert surge.id not in {r.id for r in h.replicas()} and surge.id not in h.launcher.ids()
    big = h.replicas("big")[0]
    assert big.state is ReplicaState.PENDING and not big.placed
    state = h.controller.scheduler.state
    assert old.id in state.allocations and big.id not in state.allocations
    assert h.events("move rolled back") and h.controller.scheduling.defragmentation_moves == 0


async def test_rolling_update_of_one_replica_never_leaves_it_unrouted(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2)
    await h.reconcile()
    await h.health()
    (first,) = h.replicas("a")
    h.deploy("a", octants=2, version="2")
    await h.reconcile()
    assert h.routed("a") == [first.id]
    surge = next(r for r in h.replicas("a") if r.replaces == first.id)
    assert surge.version == "2" and surge.state is ReplicaState.STARTING
    await h.health()
    assert h.routed("a") == [surge.id]
    assert [r.id for r in h.replicas("a")] == [surge.id]
    status = h.controller.rollout_status("a")
    assert status["complete"] and status["revision"] == 2 and [x["revision"] for x in status["history"]] == [1, 2]
    h.controller.rollout_undo("a")
    await h.reconcile()
    await h.health()
    (back,) = h.replicas("a")
    assert back.version == "" and h.controller.rollout_status("a")["revision"] == 3
    h.deploy("solo")
    with pytest.raises(InvalidSpecError, match="no earlier revision"):
        h.controller.rollout_undo("solo")


async def test_a_failed_rolling_update_keeps_the_old_replica(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2)
    await h.reconcile()
    await h.health()
    (first,) = h.replicas("a")
    h.deploy("a", octants=2, model="m2")
    await h.reconcile()
    surge = next(r for r in h.replicas("a") if r.replaces)
    h.launcher.crash(surge.id)
    await h.health()
    assert [r.id for r in h.replicas("a")] == [first.id] and h.routed("a") == [first.id]
    assert h.events("rollout failed")
    await h.reconcile()
    assert not [r for r in h.replicas("a") if r.replaces]  # backs off before trying again


async def test_the_loop_survives_store_errors_and_readiness_reports_it(tmp_path: Path) -> None:
    h = Harness(tmp_path, interval_s=1.0, health_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.02)
    h.deploy("a")
    c = h.controller
    broken = {"on": False}
    real, peek = h.store.replicas, h.store.peek_replicas

    def replicas(deployment: str | None = None) -> list:  # type: ignore[type-arg]
        if broken["on"]:
            raise OperationalError("SELECT", {}, Exception("database is locked"))
        return real(deployment)

    def peek_replicas(deployment: str | None = None) -> list:  # type: ignore[type-arg]
        replicas(deployment)
        return peek(deployment)

    h.store.replicas = replicas  # type: ignore[method-assign]
    h.store.peek_replicas = peek_replicas  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    await _until(lambda: h.ready("a"))
    assert c.ready() == (True, "")
    broken["on"] = True
    await asyncio.sleep(0.1)
    h.clock.advance(c.settings.stall_after_s + 1)
    await asyncio.sleep(0.1)
    ok, why = c.ready()
    assert not ok and "database is locked" in why and not task.done()
    broken["on"] = False
    await _until(lambda: c.ready()[0])
    assert c.ready() == (True, "")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert c.ready() == (False, "the controller's loop is not running")


async def test_writes_the_store_refuses_are_retried_in_order_and_readiness_reports_them(tmp_path: Path) -> None:
    h = Harness(tmp_path, interval_s=1.0, health_interval_s=0.01)
    h.deploy("a")
    c = h.controller
    locked = {"on": False}
    real = h.backing.put_replica

    def put_replica(r: Replica) -> None:
        if locked["on"]:
            raise OperationalError("UPDATE", {}, Exception("database is locked"))
        real(r)

    h.backing.put_replica = put_replica  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    await _until(lambda: h.ready("a"))
    c.store.flush(5)
    locked["on"] = True
    (r,) = h.replicas("a")
    h.launcher.crash(r.id)
    # decided at once, from memory, while the database refuses the write
    await _until(lambda: h.replicas("a")[0].state is ReplicaState.FAILED)
    assert h.replicas("a")[0].state is ReplicaState.FAILED and c.store.backlog > 0
    assert h.backing.replicas("a")[0].state is ReplicaState.READY
    assert c.ready() == (True, "")
    h.clock.advance(c.settings.stall_after_s + 1)
    ok, why = c.ready()
    assert not ok and "refused the controller's writes" in why and "database is locked" in why
    locked["on"] = False
    assert await asyncio.to_thread(c.store.flush, 5)
    await _until(lambda: c.ready() == (True, ""))  # an iteration completes after the clock jumped
    assert c.store.failing is None
    stop.set()
    await asyncio.wait_for(task, 5)  # what is queued is stored as the loop ends
    assert h.backing.replicas() == h.replicas()  # nothing lost or reordered
    assert h.backing.events(1000) == c.store.events(1000)
    assert any(e["kind"] == "failed" for e in h.backing.events(1000))


async def test_stopping_never_blocks_the_event_loop(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a")
    await h.reconcile()
    await h.health()
    slow = h.launcher.stop

    def stop(handle: str, grace: float = 5.0) -> None:
        import time

        time.sleep(0.3)  # a process that takes its time to exit
        slow(handle, grace)

    h.launcher.stop = stop  # type: ignore[method-assign]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.create_task(ticker())
    h.controller.undeploy("a")
    await h.settle()
    t.cancel()
    assert ticks >= 15 and h.replicas("a") == []


def test_events_of_a_tenant_are_its_own(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", tenant="acme")
    h.deploy("a-b", tenant="other")  # shares a prefix
    mine = h.store.events(100, tenant="acme")
    assert mine and all(e["deployment"] == "a" for e in mine)


async def test_preemption_stops_the_victim_first_and_places_it_again(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    before = {r.id: r for r in h.replicas()}
    h.deploy("vip", octants=8, priority=10)
    await h.reconcile()
    (event,) = h.events("preempted")
    victim = before[str(event["subject"])]
    assert event["deployment"] == victim.deployment and h.controller.scheduling.preemptions == 1
    assert victim.id not in h.launcher.ids() and h.replicas("vip")[0].node == victim.node
    for _ in range(3):
        await h.health()
    assert h.ready("vip") and h.ready(victim.deployment)
    again = h.ready(victim.deployment)[0]
    assert again.id == victim.id and again.node != victim.node
    state = h.controller.scheduler.state
    assert {a.request.name for a in state} == {r.id for r in h.replicas()}


async def test_a_controller_restart_in_the_middle_of_a_move_loses_nothing(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    h.deploy("big", octants=8)
    await h.reconcile()
    surge = next(r for r in h.replicas() if r.replaces)
    h.routes.routes.clear()
    h.controller = h.make()  # the old one is gone; the processes live on
    h.controller.adopt()
    state = h.controller.scheduler.state
    assert {a.request.name for a in state} == {r.id for r in h.replicas() if r.placed}
    assert surge.id not in {r.id for r in h.replicas()}  # it was not ready: the move was rolled back
    assert h.routed(surge.deployment) == [surge.replaces]  # the old one serves on
    for _ in range(4):
        await h.reconcile()
        await h.health()
    assert h.ready("big") and surge.deployment in {r.deployment for r in h.ready(surge.deployment)}
    assert surge.replaces not in h.launcher.ids()  # the move was made again, and the replaced replica stopped
    assert {a.request.name for a in state} == {r.id for r in h.replicas()}
    assert h.launcher.ids() == {r.id for r in h.replicas()}


async def test_a_move_whose_replacement_cannot_even_launch_leaves_everything_as_it_was(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await fragment(h)
    before = {r.id: (r.node, r.gpus, r.state) for r in h.replicas()}
    h.launcher.refuse = {"a2", "b2"}
    h.deploy("big", octants=8)
    await h.reconcile()
    assert {r.id: (r.node, r.gpus, r.state) for r in h.replicas() if r.id in before} == before
    big = h.replicas("big")[0]
    assert big.state is ReplicaState.PENDING and not big.placed
    state = h.controller.scheduler.state
    assert {a.request.name for a in state} == set(before)
    assert h.events("move rolled back")


async def test_a_redeploy_keeps_the_replica_count_an_operator_set(tmp_path: Path) -> None:
    """Changing a deployment's bounds keeps the count it was scaled to (clamped to the new bounds), not min."""
    h = Harness(tmp_path, nodes=fleet(2, 2))
    spec = DeploymentSpec("a", "m", octants=2, min_replicas=1, max_replicas=4)
    h.controller.deploy(spec)
    h.controller.scale("a", 3)
    h.controller.deploy(dataclasses.replace(spec, max_replicas=8))
    assert h.store.get_deployment("a").replicas == 3
    h.controller.deploy(dataclasses.replace(spec, max_replicas=2))
    assert h.store.get_deployment("a").replicas == 2  # within the new bounds


async def test_a_released_slice_wakes_the_controller_while_replicas_wait(tmp_path: Path) -> None:
    # One card, full with two replicas of tenant acme's "a"; tenant other's "b" waits. Scaling "a" down frees half
    # the card: the stop wakes the controller at once (what a pending replica waits for must not wait for the next
    # tick), and b starts there, whoever's replica left.
    h = Harness(tmp_path, nodes=fleet(1, 1))
    h.deploy("a", octants=4, replicas=2, tenant="acme")
    await h.reconcile()
    await h.health()
    h.deploy("b", octants=4, tenant="other")
    await h.reconcile()
    assert [r.state for r in h.replicas("b")] == [ReplicaState.PENDING]
    h.controller.wakeup.event = wake = asyncio.Event()  # what the running controller waits on between ticks
    d = h.store.get_deployment("a")
    d.replicas = 1
    h.store.put_deployment(d)
    await h.reconcile()  # a replica of "a" drains and stops in the background
    assert wake.is_set()
    wake.clear()
    await h.reconcile()
    assert [r.state for r in h.replicas("b")] == [ReplicaState.STARTING]
    h.controller.undeploy("b")  # nothing waits any more: a release wakes nobody
    await h.settle()
    wake.clear()
    d.replicas = 0
    h.store.put_deployment(d)
    await h.reconcile()
    assert not wake.is_set()
