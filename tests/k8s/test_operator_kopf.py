"""kopf itself runs the operator against kmock's Kubernetes emulator (discovery, watch streams, patches over HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import kopf
import pytest

from octacloud.k8s.api import KubeClient
from octacloud.k8s.operator import GROUP, PLURAL, VERSION, register_handlers
from octacloud.k8s.resources import OCTANTS

CR = f"{GROUP}/{VERSION}/{PLURAL}"


def stored(kmock: Any, *key: str) -> bool:
    try:
        kmock.objects[key]
    except KeyError:
        return False
    return True


async def until(check: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_kopf_reconciles_an_inference_deployment(kmock: Any) -> None:
    kmock.resources[CR] = {
        "namespaced": True,
        "kind": "InferenceDeployment",
        "subresources": {"status"},
        "verbs": {"get", "list", "watch", "patch", "update", "create"},
    }
    for res, kind in (("apps/v1/deployments", "Deployment"), ("v1/services", "Service"), ("v1/pods", "Pod")):
        kmock.resources[res] = {"namespaced": True, "kind": kind, "verbs": {"get", "list", "create", "patch"}}
    kmock.resources["v1/nodes"] = {"namespaced": False, "kind": "Node", "verbs": {"get", "list"}}
    # kopf waits until it has discovered namespaces and CRDs (it watches both to follow the cluster's changes)
    kmock.resources["v1/namespaces"] = {"namespaced": False, "kind": "Namespace", "verbs": {"get", "list", "watch"}}
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = {
        "namespaced": False,
        "kind": "CustomResourceDefinition",
        "verbs": {"get", "list", "watch"},
    }
    kmock.objects[CR, "ml", "bert"] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bert", "namespace": "ml", "uid": "uid-1", "resourceVersion": "1", "generation": 1},
        "spec": {"model": "bert", "octants": 4, "replicas": 2, "tenant": "acme"},
    }
    url = str(kmock.url).rstrip("/")
    registry = kopf.OperatorRegistry()
    register_handlers(lambda: KubeClient(url), registry=registry)

    session = aiohttp.ClientSession()  # ours, so that it is closed when the test ends

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.AiohttpSession:
        return kopf.AiohttpSession(server=url, aiohttp_session=session)

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        kopf.operator(registry=registry, settings=settings, clusterwide=True, standalone=True, stop_flag=stop)
    )
    try:
        await until(lambda: stored(kmock, "apps/v1/deployments", "ml", "bert"))
        deployment = kmock.objects["apps/v1/deployments", "ml", "bert"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"][OCTANTS] == "4"
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        await until(lambda: stored(kmock, "v1/services", "ml", "bert"))
        status_path = f"/apis/{GROUP}/{VERSION}/namespaces/ml/{PLURAL}/bert/status"

        def status_patches() -> list[Any]:
            return [r.data for r in kmock._requests if r.method == "PATCH" and str(r.url.path) == status_path]

        await until(lambda: bool(status_patches()))  # kopf patched the status subresource with our status
        status = status_patches()[0]["status"]
        assert status["replicas"] == 2 and status["octantsTotal"] == 8 and status["phase"] == "Progressing"
        created = [r for r in kmock._requests if r.method == "POST"]
        assert {str(r.url.path) for r in created} >= {
            "/apis/apps/v1/namespaces/ml/deployments",
            "/api/v1/namespaces/ml/services",
        }
    finally:
        stop.set_result(None)
        await asyncio.wait_for(task, 30)
        await session.close()
