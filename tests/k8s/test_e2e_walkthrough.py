"""docs/kubernetes.md's walk-through on the real control plane: ``deploy/k8s/`` applied as ``kubectl apply -f``
would (file by file, in name order), then the example InferenceDeployment, its pods bound by octacloud.

What runs in the cluster is only what needs no kubelet: the manifests' own Deployments and DaemonSet stay
Pending or unscheduled here; kube-scheduler with ``config/scheduler-config.yaml``, the extender and the operator
run as processes beside the control plane, as they would in the scheduler's and operator's pods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import node_path, pods_path
from octacloud.k8s.operator import NAME_LABEL, resource_path
from octacloud.k8s.resources import CARDS_ANNOTATION, NODE_ANNOTATION, Obj

from .cluster import (
    DEPLOY,
    ControlPlane,
    OperatorProcess,
    apply_manifest,
    delete_nodes,
    eventually,
    extender_process,
    register_nodes,
)

pytestmark = pytest.mark.slow

NODES = [Node(f"walk-a100-{k}", 32_000, 131_072, tuple(Gpu(i, "A100", 81_920) for i in range(8))) for k in (1, 2)]


def manifests(folder: Path) -> list[Obj]:
    return [d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def models_volume() -> list[Obj]:
    """The repository's volume the operator's pods mount (``modelsClaim``: octacloud-models), as an admin makes it."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "octacloud-models"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "manual",
                   "hostPath": {"path": "/srv/octacloud/models"}}}  # fmt: skip
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "octacloud-models"},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "manual", "volumeName": "octacloud-models",
                    "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    return [pv, pvc]


@pytest.fixture(scope="module")
def applied(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    repo = tmp_path_factory.mktemp("walk-repo")
    (repo / "minilm" / "1").mkdir(parents=True)
    (repo / "minilm" / "1" / "model.onnx").write_bytes(b"\0" * 4096)

    async def up() -> None:
        async with control_plane.client() as api:
            for doc in manifests(DEPLOY):
                await apply_manifest(api, doc)
            await register_nodes(api, NODES)
            for doc in models_volume():
                await apply_manifest(api, doc)

    async def down() -> None:
        async with control_plane.client() as api:
            for doc in manifests(DEPLOY / "examples"):
                if doc["kind"] == "InferenceDeployment":
                    await api.delete(resource_path("default", doc["metadata"]["name"]))
            for pod in await api.list(pods_path("default")):
                await api.request(
                    "DELETE", f"{pods_path('default')}/{pod['metadata']['name']}", {"gracePeriodSeconds": 0}
                )
            await delete_nodes(api, [n.name for n in NODES])

    asyncio.run(up())
    op = OperatorProcess(control_plane, repo)
    op.start()
    try:
        with extender_process(control_plane):
            yield control_plane
    finally:
        op.stop()
        asyncio.run(down())


async def test_deploy_k8s_applies_in_name_order_on_the_real_api_server(applied: ControlPlane) -> None:
    async with applied.client() as api:
        for kind_path, name in (
            ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", "inferencedeployments.octacloud.io"),
            ("/apis/apps/v1/namespaces/octacloud-system/daemonsets", "octacloud-device-plugin"),
            ("/apis/apps/v1/namespaces/octacloud-system/deployments", "octacloud-scheduler"),
            ("/apis/apps/v1/namespaces/octacloud-system/deployments", "octacloud-operator"),
            ("/apis/rbac.authorization.k8s.io/v1/clusterroles", "octacloud-operator"),
        ):
            assert (await api.get(f"{kind_path}/{name}"))["metadata"]["name"] == name


async def test_the_example_becomes_pods_bound_by_octacloud(applied: ControlPlane) -> None:
    async with applied.client() as api:

        async def established() -> bool:
            crd = await api.get(
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencedeployments.octacloud.io"
            )
            return any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])

        await eventually(established, "the CRD to be established")
        for doc in manifests(DEPLOY / "examples"):
            await apply_manifest(api, doc)

        async def bound() -> list[Obj] | None:
            pods = await api.list(pods_path("default"), label_selector=f"{NAME_LABEL}=minilm")
            ok = [p for p in pods if p["spec"].get("nodeName") and NODE_ANNOTATION in p["metadata"]["annotations"]]
            return ok if len(ok) == 3 else None

        pods = await eventually(bound, "minilm's three pods bound by octacloud")
        placed = [(p["spec"]["nodeName"], p["metadata"]["annotations"][CARDS_ANNOTATION]) for p in pods]
        assert all(node.startswith("walk-") for node, _ in placed)

        async def listed() -> Obj | None:
            status = (await api.get(resource_path("default", "minilm", "status"))).get("status") or {}
            return status if len([p for p in status.get("placements", []) if p["node"]]) == 3 else None

        status = await eventually(listed, "minilm's status to list its placements")
        assert status["octantsTotal"] == 6
        node = await api.get(node_path(placed[0][0]))
        assert node["status"]["allocatable"]["octacloud.io/octants"] == "64"
