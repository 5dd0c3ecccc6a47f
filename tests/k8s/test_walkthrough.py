"""All four parts together, each on its real wire format.

Device plugins advertise two nodes to their kubelets (gRPC over unix sockets, the upstream api.proto) and label
the nodes on the API; the operator turns an InferenceDeployment into a Deployment; its pods (created here as the
ReplicaSet controller would, from the Deployment's template) are filtered, scored and bound by the extender (the
JSON kube-scheduler sends); each pod's kubelet admits its container through the device plugin, which allocates the
extender's card with the slice's environment; the operator's status shows the placements.
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from octacloud.control.slices import Slice, slice_environment
from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import KubeClient
from octacloud.k8s.deviceplugin import DevicePlugin, StaticHealth, publish_node
from octacloud.k8s.extender import Extender
from octacloud.k8s.extender_http import build_extender_app
from octacloud.k8s.fakeapi import FakeApiServer
from octacloud.k8s.operator import GROUP, PLURAL, VERSION, reconcile
from octacloud.k8s.plugin_server import PluginServer
from octacloud.k8s.resources import CARDS_ANNOTATION, NODE_ANNOTATION, OCTANTS
from octacloud.scheduler.policies import cloud_profile

from .kubelet import FakeKubelet
from .wire import args_names, binding

NODES = [
    Node("gpu-a", 64_000, 524_288, tuple(Gpu(i, "A100", 81_920, 0) for i in range(4))),
    Node("gpu-b", 64_000, 524_288, tuple(Gpu(i, "A100", 81_920, 0) for i in range(4))),
]


def replicaset_pods(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """What the Deployment and ReplicaSet controllers create: ``replicas`` pods from the template."""
    template = deployment["spec"]["template"]
    name = deployment["metadata"]["name"]
    pods = []
    for k in range(deployment["spec"]["replicas"]):
        meta = copy.deepcopy(template["metadata"])
        meta.update(name=f"{name}-7d4b9c-{k}", namespace=deployment["metadata"]["namespace"])
        meta["creationTimestamp"] = f"2026-12-01T10:00:0{k}Z"
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(template["spec"])})
    return pods


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[FakeApiServer, KubeClient, dict[str, FakeKubelet]]]:
    server = FakeApiServer()
    api = KubeClient("https://k8s", transport=server.transport)
    with tempfile.TemporaryDirectory(prefix="wt-") as d:
        kubelets, stops, tasks = {}, [], []
        for node in NODES:
            server.put(
                "/api/v1",
                "nodes",
                {"metadata": {"name": node.name}, "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}}},
            )
            directory = Path(d) / node.name
            directory.mkdir()
            kubelet = FakeKubelet(directory)
            await kubelet.start()
            kubelets[node.name] = kubelet
            plugin = DevicePlugin(node, OCTANTS, StaticHealth(node), api=api)
            await publish_node(api, node, [g.health for g in node.gpus])
            stop = asyncio.Event()
            stops.append(stop)
            tasks.append(asyncio.create_task(PluginServer(plugin, directory, poll_s=0.05).run(stop)))
        try:
            for k in kubelets.values():
                await k.wait(OCTANTS)
            yield server, api, kubelets
        finally:
            for s in stops:
                s.set()
            await asyncio.gather(*tasks)
            for k in kubelets.values():
                await k.stop()
            await api.close()


async def test_walkthrough(cluster: tuple[FakeApiServer, KubeClient, dict[str, FakeKubelet]]) -> None:
    server, api, kubelets = cluster
    for name, kubelet in kubelets.items():  # the fleet as kubelet sees it: 8 octants per card
        assert len(kubelet.plugins[OCTANTS].devices) == 32, name

    extender = Extender([], cloud_profile(), api=api)
    await extender.resync()  # learns the nodes from the device plugins' labels
    assert [n.name for n in extender.state.nodes] == ["gpu-a", "gpu-b"]
    assert [n.gpu_count for n in extender.state.nodes] == [4, 4]

    cr = server.put(
        f"/apis/{GROUP}/{VERSION}",
        PLURAL,
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": {"name": "minilm", "namespace": "ml", "generation": 1},
            "spec": {"model": "minilm", "octants": 3, "replicas": 5, "tenant": "acme"},
        },
    )
    await reconcile(api, cr)
    deployment = server.get("/apis/apps/v1", "deployments", "ml", "minilm")
    pods = [server.put("/api/v1", "pods", p) for p in replicaset_pods(deployment)]
    assert all(p["spec"]["schedulerName"] == "octacloud" for p in pods)

    app = build_extender_app(extender)
    names = [n.name for n in NODES]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender") as http:
        for p in pods:  # kube-scheduler's cycle for each pod: filter, prioritize, bind
            filtered = (await http.post("/filter", json=args_names(p, names))).json()
            assert filtered["Error"] == "" and len(filtered["NodeNames"]) == 1, filtered
            scores = (await http.post("/prioritize", json=args_names(p, filtered["NodeNames"]))).json()
            node = max(scores, key=lambda h: h["Score"])["Host"]
            assert (await http.post("/bind", json=binding(p, node))).json() == {"Error": ""}

    for p in pods:  # each pod's kubelet admits its container: preferred allocation, then Allocate
        live = server.get("/api/v1", "pods", "ml", p["metadata"]["name"])
        node_name = live["spec"]["nodeName"]
        annotations = live["metadata"]["annotations"]
        assert annotations[NODE_ANNOTATION] == node_name
        card = int(annotations[CARDS_ANNOTATION])
        ids, response = await kubelets[node_name].admit(OCTANTS, 3)
        assert {d.split("-")[0] for d in ids} == {f"gpu{card}"}, (ids, card)
        env = dict(response.envs)
        node = next(n for n in NODES if n.name == node_name)
        expected = slice_environment(node, Slice(node_name, (card,), 375))
        for key in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "OCTACLOUD_OCTANTS"):
            assert env[key] == expected[key], key
        assert env["NVIDIA_VISIBLE_DEVICES"] == str(card) and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert [m.host_path for m in response.mounts] == ["/var/run/octacloud/mps"]
        live["status"] = {"phase": "Running"}

    # kubelet's view and the extender's agree: every octant kubelet handed out is one octacloud accounted
    extender_octants = sum(a.request.gpu_milli // 125 for a in extender.state)
    kubelet_octants = sum(len(k.plugins[OCTANTS].allocated) for k in kubelets.values())
    assert extender_octants == kubelet_octants == 15

    deployment["status"] = {"readyReplicas": 5, "updatedReplicas": 5}
    status = await reconcile(api, cr)
    assert status["readyReplicas"] == 5 and status["phase"] == "Ready"
    placed = {(p["node"], tuple(p["cards"])) for p in status["placements"]}
    assert placed == {(a.placement.node, a.placement.gpus) for a in extender.state}
    assert len(status["placements"]) == 5

    # the extender restarts: the same placements come back from the pods
    again = Extender([], cloud_profile(), api=api)
    await again.resync()
    assert again.placements() == extender.placements()
