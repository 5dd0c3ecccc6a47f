"""The operator (kopf) against the real API server, with the real controller-manager and kube-scheduler.

The CRD is applied from ``deploy/k8s/crd.yaml``; ``octacloud k8s operator`` and ``octacloud k8s extender`` run
as their own processes. No kubelet runs: pods are bound, never Ready, which is what a rollout with
``maxUnavailable: 0`` must survive.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import ApiError, KubeClient, is_not_found, pods_path
from octacloud.k8s.operator import GROUP, NAME_LABEL, PLURAL, VERSION, resource_path
from octacloud.k8s.resources import NODE_ANNOTATION, OCTANTS, Obj

from .cluster import (
    DEPLOY,
    ControlPlane,
    ExtenderProcess,
    OperatorProcess,
    delete_nodes,
    eventually,
    extender_process,
    namespace,
    register_nodes,
)

pytestmark = pytest.mark.slow

NS, OTHER = "e2e-operator", "e2e-operator-b"
NODES = [Node(f"op-a100-{k}", 32_000, 131_072, tuple(Gpu(i, "A100", 81_920, i // 4) for i in range(8))) for k in (1, 2)]
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def deployments(ns: str = NS) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/deployments"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    for version in ("1", "2"):
        (repo / "bert" / version).mkdir(parents=True)
        (repo / "bert" / version / "model.onnx").write_bytes(b"\0" * 4096)
    return repo


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    crd = yaml.safe_load((DEPLOY / "crd.yaml").read_text())

    async def up() -> None:
        async with control_plane.client() as api:
            await register_nodes(api, NODES)
            await namespace(api, NS)
            await namespace(api, OTHER)
            with _suppress_conflict():
                await api.create(CRD, crd)

            async def established() -> bool:
                status = (await api.get(f"{CRD}/{crd['metadata']['name']}")).get("status") or {}
                return any(c["type"] == "Established" and c["status"] == "True" for c in status.get("conditions") or [])

            await eventually(established, "the CRD to be established")

    async def down() -> None:
        async with control_plane.client() as api:
            for ns in (NS, OTHER):
                for obj in await api.list(f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"):
                    await api.delete(resource_path(ns, obj["metadata"]["name"]))
                for pod in await api.list(pods_path(ns)):  # no kubelet confirms a graceful deletion
                    await api.request("DELETE", f"{pods_path(ns)}/{pod['metadata']['name']}", {"gracePeriodSeconds": 0})
            await delete_nodes(api, [n.name for n in NODES])

    asyncio.run(up())
    yield control_plane
    asyncio.run(down())


class _suppress_conflict:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, ApiError) and exc.status == 409


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, repository: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, repository)
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="module")
def extender(cluster: ControlPlane) -> Iterator[ExtenderProcess]:
    with extender_process(cluster) as ext:
        yield ext


@pytest.fixture
async def api(cluster: ControlPlane, operator: OperatorProcess, extender: ExtenderProcess) -> AsyncIterator[KubeClient]:
    async with cluster.client() as client:
        yield client


def inference(name: str, **spec: Any) -> Obj:
    body = {"model": "bert", "octants": 4, "replicas": 2, "modelStorage": "s3://models", **spec}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name}, "spec": body}


async def create(api: KubeClient, obj: Obj, ns: str = NS) -> Obj:
    return await api.create(resource_path(ns), obj)


async def status_of(api: KubeClient, name: str, ns: str = NS) -> Obj:
    return (await api.get(resource_path(ns, name, "status"))).get("status") or {}


def conditions(status: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in status.get("conditions") or []}


async def owned(api: KubeClient, path: str, owner_uid: str) -> list[Obj] | None:
    """The objects under ``path`` that ``owner_uid`` owns (None: none yet)."""
    items = await api.list(path)
    mine = [o for o in items if any(r.get("uid") == owner_uid for r in o["metadata"].get("ownerReferences") or [])]
    return mine or None


async def test_an_inference_deployment_becomes_a_deployment_replicaset_and_bound_pods(api: KubeClient) -> None:
    cr = await create(api, inference("bert"))
    uid = cr["metadata"]["uid"]
    (dep,) = await eventually(lambda: owned(api, deployments(), uid), "the operator's Deployment")
    assert dep["metadata"]["ownerReferences"][0]["controller"] is True
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][OCTANTS] == "4"
    (rs,) = await eventually(lambda: owned(api, f"/apis/apps/v1/namespaces/{NS}/replicasets", dep["metadata"]["uid"]),
                             "the controller-manager's ReplicaSet")  # fmt: skip

    async def bound_pods() -> list[Obj] | None:
        pods = await owned(api, pods_path(NS), rs["metadata"]["uid"]) or []
        ok = [p for p in pods if p["spec"].get("nodeName") and NODE_ANNOTATION in p["metadata"].get("annotations", {})]
        return ok if len(ok) == 2 else None

    pods = await eventually(bound_pods, "two pods bound by octacloud")
    assert {p["spec"]["nodeName"] for p in pods} <= {n.name for n in NODES}

    async def placed() -> Obj | None:
        status = await status_of(api, "bert")
        return status if len([p for p in status.get("placements", []) if p["node"]]) == 2 else None

    status = await eventually(placed, "the status to list both placements")
    assert status["replicas"] == 2 and status["octantsTotal"] == 8 and status["phase"] == "Progressing"
    assert conditions(status)["Valid"]["status"] == "True" and conditions(status)["Ready"]["status"] == "False"
    live = await api.get(resource_path(NS, "bert"))
    assert live["metadata"]["generation"] == 1 and status["observedGeneration"] == 1  # status did not bump it
    # a second tenant's resource of the same name is its own Deployment
    other = await create(api, inference("bert", replicas=1, tenant="b"), OTHER)
    (theirs,) = await eventually(lambda: owned(api, deployments(OTHER), other["metadata"]["uid"]), "tenant b's")
    assert theirs["spec"]["replicas"] == 1 and theirs["metadata"]["uid"] != dep["metadata"]["uid"]


async def test_a_new_model_version_rolls_out_make_before_break(api: KubeClient) -> None:
    await eventually(lambda: _exists(api, f"{deployments()}/bert"), "bert's Deployment")
    await api.patch(resource_path(NS, "bert"), {"spec": {"version": "2"}})

    async def two_sets() -> list[Obj] | None:
        sets = await api.list(f"/apis/apps/v1/namespaces/{NS}/replicasets", label_selector=f"{NAME_LABEL}=bert")
        return sets if len(sets) == 2 else None

    sets = await eventually(two_sets, "a second ReplicaSet for the new version")
    dep = await api.get(f"{deployments()}/bert")
    assert "2" in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    by_revision = sorted(sets, key=lambda s: int(s["metadata"]["annotations"]["deployment.kubernetes.io/revision"]))
    old, new = by_revision
    # maxSurge 1, maxUnavailable 0, and no replica ever Ready (no kubelet): one new pod, every old one kept
    assert old["spec"]["replicas"] == 2 and new["spec"]["replicas"] == 1
    pods = await api.list(pods_path(NS), label_selector=f"{NAME_LABEL}=bert")
    assert len([p for p in pods if not p["metadata"].get("deletionTimestamp")]) == 3


async def test_a_deleted_deployment_is_recreated_and_drift_is_repaired(api: KubeClient) -> None:
    first = await api.get(f"{deployments()}/bert")
    await api.delete(f"{deployments()}/bert")

    async def recreated() -> Obj | None:
        try:
            dep = await api.get(f"{deployments()}/bert")
        except ApiError as exc:
            if is_not_found(exc):
                return None
            raise
        return dep if dep["metadata"]["uid"] != first["metadata"]["uid"] else None

    await eventually(recreated, "the operator to recreate bert's Deployment")
    await api.patch(f"{deployments()}/bert/scale", {"spec": {"replicas": 5}})  # someone scales it by hand

    async def repaired() -> bool:
        return (await api.get(f"{deployments()}/bert"))["spec"]["replicas"] == 2

    await eventually(repaired, "the operator to scale bert back to 2")


async def test_bad_resources_are_answered_with_what_is_wrong(api: KubeClient) -> None:
    with pytest.raises(ApiError) as refused:  # the CRD's schema: the API server itself refuses it
        await create(api, inference("minus", replicas=-1))
    assert refused.value.status == 422 and "spec.replicas" in str(refused.value)
    await create(api, inference("zero", octants=0))
    await create(api, inference("nope", model="no-such-model"))

    async def said(name: str, reason: str) -> Obj | None:
        valid = conditions(await status_of(api, name)).get("Valid")
        return valid if valid and valid["status"] == "False" and valid["reason"] == reason else None

    zero = await eventually(lambda: said("zero", "InvalidSpec"), "a condition on zero")
    assert "octants" in zero["message"]
    nope = await eventually(lambda: said("nope", "ModelNotFound"), "a condition on nope")
    assert "no-such-model" in nope["message"]
    for name in ("zero", "nope"):
        assert not await _exists(api, f"{deployments()}/{name}")


async def test_the_operator_killed_with_9_catches_up_on_restart(api: KubeClient, operator: OperatorProcess) -> None:
    operator.kill(signal.SIGKILL)
    await api.patch(resource_path(NS, "bert"), {"spec": {"replicas": 3}})  # changed while nobody watches
    operator.start()

    async def caught_up() -> bool:
        return (await api.get(f"{deployments()}/bert"))["spec"]["replicas"] == 3

    await eventually(caught_up, "the restarted operator to scale bert to 3")
    status = await eventually(lambda: _status_with(api, "bert", 3), "bert's status to say 3 replicas")
    assert status["observedGeneration"] == (await api.get(resource_path(NS, "bert")))["metadata"]["generation"]


async def _status_with(api: KubeClient, name: str, replicas: int) -> Obj | None:
    status = await status_of(api, name)
    return status if status.get("replicas") == replicas else None


async def _exists(api: KubeClient, path: str) -> bool:
    try:
        await api.get(path)
    except ApiError as exc:
        if is_not_found(exc):
            return False
        raise
    return True
