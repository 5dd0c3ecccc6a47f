"""A kubemark hollow node (the kubelet's own code with a fake container runtime) runs octacloud's pods.

The hollow kubelet registers its node and sends heartbeats itself. Its container manager is kubemark's stub,
which has no device manager, so octacloud's device plugin cannot register with it: the node's octants are
advertised as a device plugin's would be, by patching the node's status (a kubelet keeps extended resources it
did not set), and labelled as the plugin labels them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import node_path, pod_path, pods_path
from octacloud.k8s.deviceplugin import publish_node
from octacloud.k8s.resources import GPUS, NODE_ANNOTATION, OCTANTS, Obj

from .cluster import ControlPlane, ExtenderProcess, eventually, extender_process, namespace, pod_manifest

pytestmark = pytest.mark.slow

NS = "e2e-hollow"
HOLLOW = Node("hollow-1", 4_000, 8_192, tuple(Gpu(i, "L4", 23_034) for i in range(2)))


def _heartbeat(node: Obj) -> str:
    return str(next(c for c in node["status"]["conditions"] if c["type"] == "Ready")["lastHeartbeatTime"])


def _ready(node: Obj) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@pytest.fixture(scope="module")
def hollow(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    control_plane.hollow_node(HOLLOW.name)

    async def up() -> None:
        async with control_plane.client() as api:

            async def registered() -> Obj | None:
                nodes = await api.list(node_path(), field_selector=f"metadata.name={HOLLOW.name}")
                return nodes[0] if nodes and _ready(nodes[0]) else None

            await eventually(registered, "the hollow node to register itself Ready")
            extended = {OCTANTS: str(8 * HOLLOW.gpu_count), GPUS: str(HOLLOW.gpu_count)}
            await api.patch(
                f"{node_path(HOLLOW.name)}/status", {"status": {"capacity": extended, "allocatable": extended}}
            )
            await publish_node(api, HOLLOW, [g.health for g in HOLLOW.gpus])
            await namespace(api, NS)

    asyncio.run(up())
    try:
        yield control_plane
    finally:

        async def down() -> None:
            async with control_plane.client() as api:
                for pod in await api.list(pods_path(NS)):
                    await api.request("DELETE", pod_path(NS, pod["metadata"]["name"]), {"gracePeriodSeconds": 0})
                await api.delete(node_path(HOLLOW.name))

        control_plane.stop_process(f"hollow-{HOLLOW.name}")
        asyncio.run(down())


@pytest.fixture(scope="module")
def extender(hollow: ControlPlane) -> Iterator[ExtenderProcess]:
    with extender_process(hollow) as ext:
        yield ext


async def test_a_pod_bound_by_octacloud_runs_on_a_hollow_kubelet(
    hollow: ControlPlane, extender: ExtenderProcess
) -> None:
    async with hollow.client() as api:
        first = await api.get(node_path(HOLLOW.name))
        await api.create(pods_path(NS), pod_manifest("on-hollow", octants=2, node=HOLLOW.name))

        async def running() -> Obj | None:
            pod = await api.get(pod_path(NS, "on-hollow"))
            return pod if (pod.get("status") or {}).get("phase") == "Running" else None

        pod = await eventually(running, "the pod to run on the hollow node")
        assert pod["spec"]["nodeName"] == HOLLOW.name
        assert pod["metadata"]["annotations"][NODE_ANNOTATION] == HOLLOW.name
        assert extender.placements()[pod["metadata"]["uid"]]["node"] == HOLLOW.name

        async def heartbeat_after() -> Obj | None:  # the kubelet has written its status since our patch
            node = await api.get(node_path(HOLLOW.name))
            return node if _heartbeat(node) != _heartbeat(first) else None

        node = await eventually(heartbeat_after, "a heartbeat of the hollow kubelet")
        assert node["status"]["allocatable"][OCTANTS] == "16"  # the kubelet kept the advertised octants


async def test_a_pod_asking_for_more_octants_than_advertised_is_not_bound(
    hollow: ControlPlane, extender: ExtenderProcess
) -> None:
    async with hollow.client() as api:
        await api.create(pods_path(NS), pod_manifest("too-many", gpus=3, node=HOLLOW.name))

        async def refused() -> str | None:
            events = await api.list(f"/api/v1/namespaces/{NS}/events", field_selector="involvedObject.name=too-many")
            failed = [e for e in events if e.get("reason") == "FailedScheduling"]
            return str(failed[0]["message"]) if failed else None

        message = await eventually(refused, "a FailedScheduling event for too-many")
        assert "Insufficient octacloud.io/gpus" in message, message
        assert not (await api.get(pod_path(NS, "too-many")))["spec"].get("nodeName")
