"""The controller applies fleet changes: a node joins without a restart (allocations and health carried over),
is lost (its replicas go back to placement as failover work), and comes back. No Ray, no replicas."""

from __future__ import annotations

from pathlib import Path

from octacloud.app import Cloud, CloudConfig
from octacloud.control.controller import NodeChange
from octacloud.control.deployments import Replica, ReplicaState
from octacloud.core import Gpu, Node
from octacloud.core.model import Health, Request


def node(name: str, cards: int = 2) -> Node:
    return Node(name, 4000, 16384, tuple(Gpu(i, "T4", 16384) for i in range(cards)))


def test_nodes_join_fail_and_return(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    cloud = Cloud(CloudConfig(repository=tmp_path / "models", state_dir=tmp_path / "var"), nodes=[node("a")])
    controller = cloud.controller
    first = cloud.scheduler.schedule(Request("r1", num_gpu=1, gpu_milli=250))
    assert first.placement is not None and first.placement.node == "a"
    cloud.state.set_card_health("a", 1, Health.FAILED)
    controller.store.put_replica(
        Replica("r1", "d", node="a", gpus=first.placement.gpus, milli_per_gpu=250, state=ReplicaState.READY)
    )

    controller.node_changed(NodeChange(node("b", 4), Health.HEALTHY))
    state = cloud.state
    assert [n.name for n in state.nodes] == ["a", "b"] and [n.name for n in cloud.nodes] == ["a", "b"]
    assert state.allocations["r1"].placement == first.placement  # nothing running was forgotten
    assert state.allocated_gpu_milli == 250 and state.total_gpu_milli == 6000
    assert state.nodes[0].gpus[1].health is Health.FAILED  # health carried over
    assert cloud.scheduler.state is state and controller.scheduler is cloud.scheduler
    assert any(e["kind"] == "node" and e["message"].startswith("joined") for e in controller.store.events())
    controller.node_changed(NodeChange(node("b", 4), Health.HEALTHY))  # seen again: nothing changes
    assert len(cloud.state.nodes) == 2

    controller.node_changed(NodeChange(node("a"), Health.FAILED))
    assert cloud.state.nodes[0].health is Health.FAILED and "r1" not in cloud.state.allocations
    r1 = controller.store.replicas("d")[0]
    assert r1.state is ReplicaState.PENDING and r1.failover and r1.message == "node a failed" and not r1.node
    moved = cloud.scheduler.schedule(Request("r1", num_gpu=1, gpu_milli=250, failover=True))
    assert moved.placement is not None and moved.placement.node == "b"

    controller.node_changed(NodeChange(node("a"), Health.HEALTHY))
    assert cloud.state.nodes[0].health is Health.HEALTHY and cloud.state.usable(0)
