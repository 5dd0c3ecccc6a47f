"""The extender behind the real kube-scheduler (v1.36 here), with the configuration ``deploy/k8s/`` ships.

Nodes are registered through the real API server (status with the device plugin's resources, labels as the
device plugin writes them); ``octacloud k8s extender`` runs as its own process. Pods are created through the API
and kube-scheduler decides when to call which verb.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import KubeClient, is_not_found, pod_path, pods_path
from octacloud.k8s.resources import CARDS_ANNOTATION, MILLI_ANNOTATION, NODE_ANNOTATION, Obj

from .cluster import (
    ControlPlane,
    ExtenderProcess,
    delete_nodes,
    eventually,
    extender_process,
    namespace,
    pod_manifest,
    register_nodes,
)

pytestmark = pytest.mark.slow

NS = "e2e-extender"
OTHER = "e2e-extender-b"  # a second tenant's namespace
NODES = [
    Node("a100-1", 32_000, 131_072, tuple(Gpu(i, "A100", 81_920, i // 4) for i in range(8))),
    Node("a100-2", 32_000, 131_072, tuple(Gpu(i, "A100", 81_920, i // 4) for i in range(8))),
    Node("t4-1", 16_000, 65_536, tuple(Gpu(i, "T4", 16_384) for i in range(4))),
]
PRIORITIES = {"e2e-low": 100, "e2e-high": 1000}


@pytest.fixture(scope="module")
def nodes(control_plane: ControlPlane) -> Iterator[list[Node]]:
    async def up() -> None:
        async with _client(control_plane) as api:
            await register_nodes(api, NODES)
            await namespace(api, NS)
            await namespace(api, OTHER)
            for name, value in PRIORITIES.items():
                body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}}
                await api.create("/apis/scheduling.k8s.io/v1/priorityclasses", {**body, "value": value})

    async def down() -> None:
        async with _client(control_plane) as api:
            await delete_nodes(api, [n.name for n in NODES])
            for name in PRIORITIES:
                await api.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")

    asyncio.run(up())
    yield NODES
    asyncio.run(down())


@pytest.fixture(scope="module")
def extender(control_plane: ControlPlane, nodes: list[Node]) -> Iterator[ExtenderProcess]:
    with extender_process(control_plane) as ext:
        yield ext


@pytest.fixture
async def api(control_plane: ControlPlane, extender: ExtenderProcess) -> AsyncIterator[KubeClient]:
    """A client; after the test every pod it made is deleted and the extender has given their cards back."""
    client = control_plane.client()
    yield client
    for ns in (NS, OTHER):
        for pod in await client.list(pods_path(ns)):
            await client.delete(pod_path(ns, pod["metadata"]["name"]))

    async def emptied() -> bool:
        return not await client.list(pods_path(NS)) and not await client.list(pods_path(OTHER))

    await eventually(emptied, "the test's pods to be deleted")
    await eventually(lambda: _async(not extender.placements()), "the extender to free every card")
    await client.close()


async def _async(value: Any) -> Any:
    return value


class _client:
    def __init__(self, cp: ControlPlane) -> None:
        self.api = cp.client()

    async def __aenter__(self) -> KubeClient:
        return self.api

    async def __aexit__(self, *exc: object) -> None:
        await self.api.close()


async def create(api: KubeClient, pod: Obj, ns: str = NS) -> Obj:
    return await api.create(pods_path(ns), pod)


async def bound(api: KubeClient, name: str, ns: str = NS) -> Obj:
    async def probe() -> Obj | None:
        pod = await api.get(pod_path(ns, name))
        return pod if (pod.get("spec") or {}).get("nodeName") else None

    return await eventually(probe, f"pod {ns}/{name} to be bound")


async def gone(api: KubeClient, name: str, ns: str = NS) -> None:
    async def probe() -> bool:
        try:
            await api.get(pod_path(ns, name))
        except Exception as exc:
            if is_not_found(exc):
                return True
            raise
        return False

    await eventually(probe, f"pod {ns}/{name} to be deleted")


async def events_of(api: KubeClient, name: str, ns: str = NS) -> list[Obj]:
    return await api.list(f"/api/v1/namespaces/{ns}/events", field_selector=f"involvedObject.name={name}")


def cards(pod: Obj) -> tuple[str, set[int]]:
    ann = pod["metadata"]["annotations"]
    return ann[NODE_ANNOTATION], {int(c) for c in ann[CARDS_ANNOTATION].split(",")}


async def test_a_pod_asking_for_octants_is_bound_by_octacloud_to_its_card(
    api: KubeClient, extender: ExtenderProcess
) -> None:
    await create(api, pod_manifest("share", octants=3))
    pod = await bound(api, "share")
    ann = pod["metadata"]["annotations"]
    node = pod["spec"]["nodeName"]
    assert ann[NODE_ANNOTATION] == node and ann[MILLI_ANNOTATION] == "375"
    held = extender.placements()[pod["metadata"]["uid"]]
    assert held == {"node": node, "cards": [int(ann[CARDS_ANNOTATION])], "milli": 375}
    calls: dict[str, Any] = extender.health()["calls"]
    assert calls["filter"] >= 1 and calls["bind"] >= 1


async def test_whole_cards_are_bound_on_one_node_and_never_shared(api: KubeClient, extender: ExtenderProcess) -> None:
    await create(api, pod_manifest("pair", gpus=2))
    await create(api, pod_manifest("quad", octants=32))  # four whole cards, asked for in octants
    pair, quad = cards(await bound(api, "pair")), cards(await bound(api, "quad"))
    assert len(pair[1]) == 2 and len(quad[1]) == 4
    assert pair[0] != quad[0] or not pair[1] & quad[1]
    assert (await api.get(pod_path(NS, "quad")))["spec"]["nodeName"] == quad[0]


async def test_a_pod_asking_for_nothing_stays_with_kube_scheduler(api: KubeClient, extender: ExtenderProcess) -> None:
    before = extender.health()["calls"]
    await create(api, pod_manifest("plain"))
    pod = await bound(api, "plain")
    assert not any(k.startswith("octacloud.io/") for k in pod["metadata"].get("annotations") or {})
    after = extender.health()["calls"]
    assert after.get("filter", 0) == before.get("filter", 0) and after.get("bind", 0) == before.get("bind", 0)


async def test_a_pod_that_fits_nowhere_gets_an_event_saying_why(api: KubeClient, extender: ExtenderProcess) -> None:
    # more cards than any node has: kube-scheduler's own resource fit says so (the device plugin's allocatable)
    await create(api, pod_manifest("huge", gpus=12))
    # one card, but of a model no node has: only octacloud knows, and its reason is in the event
    await create(api, pod_manifest("h100", gpus=1, annotations={"octacloud.io/gpu-models": "H100"}))

    async def failed(name: str) -> str | None:
        for e in await events_of(api, name):
            if e.get("reason") == "FailedScheduling":
                return str(e.get("message"))
        return None

    huge = await eventually(lambda: failed("huge"), "a FailedScheduling event for pod huge")
    assert "0/3 nodes are available" in huge and "Insufficient octacloud.io/gpus" in huge, huge
    h100 = await eventually(lambda: failed("h100"), "a FailedScheduling event for pod h100")
    assert f"pod {NS}/h100 does not fit" in h100, h100
    assert "asks for 1 card(s) x 1000 milli-GPU of H100; node t4-1 has 4 T4 card(s), 0 suitable" in h100, h100
    for name in ("huge", "h100"):
        assert not (await api.get(pod_path(NS, name)))["spec"].get("nodeName")


async def test_two_tenants_with_the_same_pod_name_get_their_own_cards(
    api: KubeClient, extender: ExtenderProcess
) -> None:
    # t4-1 has four cards: two tenants ask for two each with the same pod name, pinned there
    await create(api, pod_manifest("model", gpus=2, node="t4-1"))
    await create(api, pod_manifest("model", gpus=2, node="t4-1"), OTHER)
    a, b = cards(await bound(api, "model")), cards(await bound(api, "model", OTHER))
    assert a[0] == b[0] == "t4-1" and not a[1] & b[1] and len(a[1] | b[1]) == 4
    assert len(extender.placements()) == 2


async def test_a_malformed_client_gets_an_error_and_the_extender_keeps_binding(
    api: KubeClient, extender: ExtenderProcess, control_plane: ControlPlane
) -> None:
    url = f"http://127.0.0.1:{control_plane.extender_port}"
    async with httpx.AsyncClient(base_url=url) as client:
        junk = await client.post("/filter", content=b"{not json", headers={"Content-Type": "application/json"})
        assert "Error" in junk.json() and junk.json()["Error"]
        empty = await client.post("/bind", json={"PodName": "", "Node": "a100-1"})
        assert "PodName" in empty.json()["Error"]
        ghost = await client.post("/filter", json={"Pod": {"metadata": {"name": "x"}}, "NodeNames": ["nowhere"]})
        assert ghost.status_code == 200
    await create(api, pod_manifest("after-junk", octants=1))
    assert (await bound(api, "after-junk"))["metadata"]["annotations"][NODE_ANNOTATION]


async def test_a_node_list_scheduler_sends_node_objects_and_binds_the_same(
    api: KubeClient, extender: ExtenderProcess
) -> None:
    before = extender.health()["calls"].get("filter-nodes", 0)
    await create(api, pod_manifest("by-objects", octants=8, scheduler="octacloud-nodes"))
    pod = await bound(api, "by-objects")
    node, held = cards(pod)
    assert pod["spec"]["nodeName"] == node and len(held) == 1
    assert extender.health()["calls"]["filter-nodes"] > before


async def test_preemption_evicts_only_lower_priority_octacloud_pods(api: KubeClient, extender: ExtenderProcess) -> None:
    for k in range(4):  # t4-1's four cards, each held by a low-priority pod
        await create(api, pod_manifest(f"low-{k}", gpus=1, node="t4-1", priority_class="e2e-low"))
    await create(api, pod_manifest("low-plain", node="t4-1", priority_class="e2e-low"))  # not octacloud's
    await create(api, pod_manifest("high-peer", gpus=1, node="a100-1", priority_class="e2e-high"))
    for k in range(4):
        await bound(api, f"low-{k}")
    await bound(api, "low-plain")
    await create(api, pod_manifest("high", gpus=2, node="t4-1", priority_class="e2e-high"))
    pod = await bound(api, "high")
    assert cards(pod)[0] == "t4-1"
    left = {p["metadata"]["name"] for p in await api.list(pods_path(NS)) if not p["metadata"].get("deletionTimestamp")}
    assert {"low-plain", "high-peer", "high"} <= left
    assert len([n for n in left if n.startswith("low-") and n != "low-plain"]) == 2  # only as many as needed
    assert extender.health()["calls"]["preempt"] >= 1


async def test_after_kill_9_the_extender_rebuilds_its_state_and_decides_the_same(
    api: KubeClient, extender: ExtenderProcess
) -> None:
    for k in range(3):
        await create(api, pod_manifest(f"keep-{k}", octants=3 + k))
        await bound(api, f"keep-{k}")
    before = extender.placements()
    extender.kill(signal.SIGKILL)
    extender.start()
    assert extender.placements() == before  # rebuilt from the pods' annotations
    await create(api, pod_manifest("next", octants=8))
    node, new = cards(await bound(api, "next"))
    for held in before.values():
        assert held["node"] != node or not new & set(held["cards"])  # no card given twice
