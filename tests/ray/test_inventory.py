"""A server's inventory as Ray resources and labels, and the fleet watcher over Ray's node table (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from octacloud.control.ray.backend import RayFleet
from octacloud.control.ray.inventory import (
    node_from_ray,
    node_labels,
    node_resources,
    ray_start_command,
    slice_resources,
)
from octacloud.core import Gpu, Node
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Health

A100 = Node(
    "gpu-a",
    64000,
    262144,
    tuple(Gpu(i, "A100-SXM4-80GB", 81920, 0 if i < 4 else None) for i in range(8)),
    labels={"zone": "a", "octacloud.io/accelerator": "nvidia"},
)


def entry(node: Node, node_id: str, alive: bool = True) -> dict[str, Any]:
    """A ``ray.nodes()`` entry as a raylet started by ``octacloud node start`` reports it."""
    resources = {"CPU": node.cpu_milli / 1000, "memory": float(node.memory_mib * 2**20), **node_resources(node)}
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": "10.0.0.7",
        "Resources": resources if alive else {},
        "Labels": node_labels(node),
    }


def test_resources_and_labels_round_trip() -> None:
    resources = node_resources(A100)
    assert resources == {**{f"gpu{i}_octant": 8.0 for i in range(8)}, "octacloud_node:gpu-a": 1.0}
    labels = node_labels(A100)
    assert labels["octacloud.io/gpu-model"] == "A100-SXM4-80GB"
    assert labels["octacloud.io/gpu-memory-mib"] == "81920"
    assert labels["octacloud.io/nvlink-groups"] == "0-0-0-0-x-x-x-x"
    assert labels["octacloud.io/zone"] == "a" and labels["octacloud.io/accelerator"] == "nvidia"
    back = node_from_ray(entry(A100, "n1"))
    assert back is not None
    assert (back.name, back.cpu_milli, back.memory_mib) == ("gpu-a", 64000, 262144)
    assert back.gpus == A100.gpus
    assert back.labels["octacloud.io/zone"] == "a"


def test_slice_resources_are_the_cards_octants() -> None:
    assert slice_resources((3,), 250) == {"gpu3_octant": 2.0}
    assert slice_resources((0, 1), 1000) == {"gpu0_octant": 8.0, "gpu1_octant": 8.0}


def test_inventories_ray_cannot_carry_are_refused() -> None:
    mixed = Node("mixed", 1000, 1024, (Gpu(0, "A100", 81920), Gpu(1, "T4", 16384)))
    with pytest.raises(InvalidSpecError, match="cards differ"):
        node_labels(mixed)
    odd = Node("odd", 1000, 1024, (Gpu(0, "A100 (PCIe)", 81920),))
    with pytest.raises(InvalidSpecError, match="not a valid Ray label value"):
        node_labels(odd)
    broken = entry(A100, "n1")
    del broken["Resources"]["gpu3_octant"]
    with pytest.raises(InvalidSpecError, match="gpu0_octant..gpuN_octant"):
        node_from_ray(broken)
    assert node_from_ray({"NodeID": "x", "Alive": True, "Resources": {"CPU": 4.0}}) is None  # not ours


def test_fleet_watcher_sees_joins_deaths_and_returns() -> None:
    b = Node("gpu-b", 8000, 65536, (Gpu(0, "T4", 16384),))
    table: list[dict[str, Any]] = [entry(A100, "n1"), {"NodeID": "head", "Alive": True, "Resources": {"CPU": 2.0}}]
    fleet = RayFleet(lambda: table)
    assert [n.name for n in fleet.discover()] == ["gpu-a"]
    assert fleet.node_id("gpu-a") == "n1" and fleet.address("gpu-a") == "10.0.0.7"
    assert fleet.poll() == []

    table.append(entry(b, "n2"))
    changes = fleet.poll()
    assert [(c.node.name, c.health) for c in changes] == [("gpu-b", Health.HEALTHY)]

    table[0] = entry(A100, "n1", alive=False)  # its raylet died: Ray reports no resources any more
    changes = fleet.poll()
    assert [(c.node.name, c.health) for c in changes] == [("gpu-a", Health.FAILED)]
    assert changes[0].node.gpu_count == 8  # the node as it was known while alive
    assert fleet.node_id("gpu-a") is None
    assert fleet.poll() == []

    table.append(entry(A100, "n3"))  # the server came back: a new raylet, a new Ray node id
    assert [(c.node.name, c.health) for c in fleet.poll()] == [("gpu-a", Health.HEALTHY)]
    assert fleet.node_id("gpu-a") == "n3"


def test_ray_start_command() -> None:
    argv = ray_start_command(A100, ray="ray", head=True, port=6380, system_config={"health_check_period_ms": 500})
    assert argv[:4] == ["ray", "start", "--head", "--port=6380"]
    assert "--num-gpus=0" in argv and "--num-cpus=64" in argv and "--include-dashboard=false" in argv
    assert any(a.startswith("--resources=") and '"gpu7_octant": 8.0' in a for a in argv)
    assert any(a.startswith("--labels=") and "octacloud.io/gpu-model=A100-SXM4-80GB" in a for a in argv)
    assert '--system-config={"health_check_period_ms": 500}' in argv
    joined = ray_start_command(A100, ray="ray", head=False, address="10.0.0.1:6379", node_ip="10.0.0.2", block=True)
    assert joined[2:3] == ["--address=10.0.0.1:6379"] and "--node-ip-address=10.0.0.2" in joined
    assert joined[-1] == "--block" and not any(a.startswith("--system-config") for a in joined)
    with pytest.raises(InvalidSpecError, match="either --head"):
        ray_start_command(A100, ray="ray", head=True, address="10.0.0.1:6379")
