"""What keeps the controller's work proportional to the fleet: launches side by side (a bounded few at a time),
one route update per deployment per health check, and a pass that copies only the replicas it changes."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from octacloud.control.controller import NodeChange, lifecycle
from octacloud.control.deployments import DeploymentSpec, ReplicaState
from octacloud.control.launcher import Launched, LaunchSpec
from octacloud.core.model import Gpu, Health, Node
from octacloud.gateway.routing import Endpoint, RouteTable
from octacloud.scheduler.framework.runner import Scheduler

from .controller_fakes import FakeLauncher, Harness, fleet


class GatedLauncher(FakeLauncher):
    """Once :meth:`gate` is called, each launch waits until ``together`` launches are in flight at once (a launch
    fails after 60 s if they never are); counts the most in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.barrier: threading.Barrier | None = None
        self.lock = threading.Lock()
        self.now = self.most = 0

    def gate(self, together: int) -> None:
        self.barrier = threading.Barrier(together, timeout=60)

    def launch(self, spec: LaunchSpec) -> Launched:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self.barrier is not None:
                self.barrier.wait()  # BrokenBarrierError (the launch fails) if launches came one at a time
            with self.lock:
                return super().launch(spec)
        finally:
            with self.lock:
                self.now -= 1


def gated(tmp: Path, nodes: int) -> tuple[Harness, GatedLauncher]:
    h = Harness(tmp, nodes=fleet(nodes=nodes, cards=8))
    launcher = GatedLauncher()
    h.launcher = launcher
    h.controller = h.make()
    return h, launcher


async def test_a_pass_launches_its_replicas_side_by_side_a_few_at_a_time(tmp_path: Path) -> None:
    h, launcher = gated(tmp_path, nodes=4)
    launcher.gate(lifecycle.LAUNCHES_AT_ONCE)
    h.deploy("a", octants=1, replicas=3 * lifecycle.LAUNCHES_AT_ONCE)
    await h.reconcile()
    started = [r for r in h.replicas("a") if r.state is ReplicaState.STARTING]
    assert len(started) == 3 * lifecycle.LAUNCHES_AT_ONCE  # launched in groups that each met at the barrier
    assert launcher.most == lifecycle.LAUNCHES_AT_ONCE  # never more than the bound at once


async def test_failed_replicas_restart_side_by_side_at_a_health_check(tmp_path: Path) -> None:
    h, launcher = gated(tmp_path, nodes=2)
    h.deploy("a", octants=2, replicas=4)
    await h.reconcile()
    await h.health()
    for r in h.replicas("a"):
        h.launcher.crash(r.id)
    await h.health()
    assert all(r.state is ReplicaState.FAILED for r in h.replicas("a"))
    launcher.gate(4)  # the four restarts must be in flight together
    h.clock.advance(1.0)
    await h.health()
    assert all(r.state is ReplicaState.STARTING and r.restarts == 1 for r in h.replicas("a"))


class CountedRoutes(RouteTable):
    """A route table that keeps every update it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[tuple[str, list[str]]] = []

    def update(self, deployment: str, endpoints: Iterable[Endpoint]) -> None:
        endpoints = list(endpoints)
        self.updates.append((deployment, [e.replica_id for e in endpoints]))
        super().update(deployment, endpoints)


async def test_a_health_check_routes_each_deployment_once_however_many_became_ready(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(nodes=2, cards=8))
    h.routes = routes = CountedRoutes()
    h.controller = h.make()
    h.deploy("a", octants=1, replicas=6)
    h.deploy("b", octants=2, replicas=3)
    await h.reconcile()
    updates = routes.updates
    updates.clear()
    await h.health()
    assert sorted(d for d, _ in updates) == ["a", "b"]  # not one update per replica that became ready
    assert dict(updates) == {d: sorted(r.id for r in h.replicas(d)) for d in ("a", "b")}  # all of each, in id order
    assert sorted(h.routed("a")) == sorted(r.id for r in h.ready("a"))


async def test_a_second_tenants_replicas_are_launched_and_routed_alongside_the_first(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(nodes=2, cards=8))
    h.deploy("a", octants=1, replicas=5, tenant="one")
    h.deploy("b", octants=1, replicas=5, tenant="two")
    await h.reconcile()
    await h.health()
    assert len(h.routed("a")) == 5 and len(h.routed("b")) == 5
    assert {e["tenant"] for e in h.events("ready") if e["deployment"] == "b"} == {"two"}


async def test_a_steady_pass_changes_nothing_it_only_looked_at(tmp_path: Path) -> None:
    """The pass reads the stored records without copying them: what it did not act on is the very same record."""
    h = Harness(tmp_path, nodes=fleet(nodes=2, cards=8))
    h.deploy("a", octants=2, replicas=4)
    await h.reconcile()
    await h.health()
    before = {r.id: r for r in h.store.peek_replicas()}
    as_they_were = h.store.replicas()  # copies
    await h.reconcile()
    await h.health()
    after = {r.id: r for r in h.store.peek_replicas()}
    assert before.keys() == after.keys() and all(after[k] is before[k] for k in before)  # nothing stored anew
    assert sorted(after.values(), key=lambda r: r.id) == as_they_were  # nor changed in place


class RefreshedLauncher(FakeLauncher):
    """A launcher whose ``alive`` reads what ``refresh`` fetched (as the emulated fleet's host listings)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []
        """("refresh" or "alive", whether on the event loop's thread)."""

    def refresh(self) -> None:
        self.calls.append(("refresh", threading.current_thread() is threading.main_thread()))

    def alive(self, handle: str) -> bool:
        self.calls.append(("alive", threading.current_thread() is threading.main_thread()))
        return super().alive(handle)


async def test_what_alive_reads_is_refreshed_off_the_event_loop_before_each_check(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(nodes=1, cards=8))
    h.launcher = launcher = RefreshedLauncher()
    h.controller = h.make()
    h.deploy("a", octants=2, replicas=3)
    await h.reconcile()
    launcher.calls.clear()
    await h.health()
    assert launcher.calls[0] == ("refresh", False)  # first, and in a thread
    assert launcher.calls[1:] == [("alive", True)] * 3  # then the check itself reads it, on the loop
    assert len(h.routed("a")) == 3


async def test_nodes_that_join_together_join_in_one_rebuild_and_take_the_waiting_work(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(nodes=1, cards=2))
    h.controller.deploy(DeploymentSpec("a", "m", octants=8, min_replicas=2, max_replicas=4))  # the fleet's 2 cards
    await h.reconcile()
    await h.health()
    grown: list[int] = []
    real = h.controller.reservations.grow

    def grow(*nodes: Node) -> Scheduler:
        grown.append(len(nodes))
        return real(*nodes)

    h.controller.reservations.grow = grow  # type: ignore[method-assign]
    joining = [Node(f"j{i}", 16_000, 65_536, (Gpu(0, "T4", 16_384),)) for i in range(3)]
    lost = Node("j2", 16_000, 65_536, (Gpu(0, "T4", 16_384),))
    h.controller.nodes_changed(
        [*(NodeChange(n, Health.HEALTHY) for n in joining), NodeChange(joining[0], Health.HEALTHY),
         NodeChange(lost, Health.FAILED)]
    )  # fmt: skip
    assert grown == [3]  # one rebuild for the three, the repeated report changes nothing
    state = h.controller.scheduler.state
    assert [n.name for n in state.nodes] == ["n0", "j0", "j1", "j2"]
    assert not state.usable(state.node_index("j2"))  # lost after it joined, in the same report
    h.controller.scale("a", 4)  # room for two more now (j2 is lost)
    await h.reconcile()
    await h.health()
    assert sorted(r.node for r in h.replicas("a") if r.placed) == ["j0", "j1", "n0", "n0"]
    assert len(h.routed("a")) == 4
