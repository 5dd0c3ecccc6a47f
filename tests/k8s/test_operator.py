"""The InferenceDeployment operator against the in-memory API server: the requests it sends, and its status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from octacloud.control.sizing import ModelFootprint
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Placement
from octacloud.k8s.api import KubeClient
from octacloud.k8s.fakeapi import FakeApiServer
from octacloud.k8s.operator import (
    GROUP,
    NAME_LABEL,
    PLURAL,
    VERSION,
    reconcile,
    register_handlers,
    resource_path,
)
from octacloud.k8s.resources import OCTANTS, placement_annotations

from .conftest import fleet
from .wire import node_obj, pod

CR_PREFIX = f"/apis/{GROUP}/{VERSION}"
DEPLOYMENTS = "/apis/apps/v1/namespaces/ml/deployments"


def inference(name: str = "bert", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": "ml", "generation": 1},
        "spec": {"model": "bert", "octants": 2, "replicas": 3, "tenant": "acme", **spec},
    }


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[FakeApiServer, KubeClient]]:
    server = FakeApiServer()
    for n in fleet():
        server.put("/api/v1", "nodes", node_obj(n))
    api = KubeClient("https://k8s", transport=server.transport)
    yield server, api
    await api.close()


async def test_creates_a_rolling_deployment_and_a_service(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, api = cluster
    cr = server.put(CR_PREFIX, PLURAL, inference(priorityClassName="octacloud-high"))
    status = await reconcile(api, cr)
    (create,) = server.sent("POST", "/deployments")
    assert create.path == DEPLOYMENTS
    d = create.body
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert d["metadata"]["ownerReferences"][0] | {} == {
        "apiVersion": "octacloud.io/v1alpha1",
        "kind": "InferenceDeployment",
        "name": "bert",
        "uid": cr["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    template = d["spec"]["template"]
    assert template["metadata"]["labels"][NAME_LABEL] == "bert"
    assert template["metadata"]["labels"]["octacloud.io/tenant"] == "acme"
    (container,) = template["spec"]["containers"]
    assert container["resources"] == {"limits": {OCTANTS: "2"}}
    assert container["command"][:2] == ["octacloud", "serve"] and container["command"][-1] == "bert"
    assert template["spec"]["priorityClassName"] == "octacloud-high"
    (service,) = server.sent("POST", "/services")
    assert service.path == "/api/v1/namespaces/ml/services"
    assert service.body["spec"]["selector"] == {NAME_LABEL: "bert"}
    assert [p["port"] for p in service.body["spec"]["ports"]] == [8000, 8001, 8002]
    assert status["replicas"] == 3 and status["readyReplicas"] == 0 and status["octantsTotal"] == 6
    assert status["phase"] == "Progressing"


async def test_reconcile_is_idempotent_and_updates_roll(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, api = cluster
    cr = server.put(CR_PREFIX, PLURAL, inference())
    await reconcile(api, cr)
    await reconcile(api, cr)
    assert not server.sent("PATCH") and len(server.sent("POST")) == 2  # nothing changed: nothing sent
    cr["spec"]["octants"], cr["spec"]["replicas"] = 4, 2
    await reconcile(api, cr)
    (patch,) = server.sent("PATCH", "/deployments/bert")
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body["spec"]["replicas"] == 2
    assert patch.body["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][OCTANTS] == "4"
    live = server.get("/apis/apps/v1", "deployments", "ml", "bert")
    assert live["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


async def test_status_reports_ready_replicas_and_placements(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, api = cluster
    cr = server.put(CR_PREFIX, PLURAL, inference(replicas=2))
    await reconcile(api, cr)
    for k, (node, card) in enumerate([("a100-1", 0), ("a100-2", 3)]):
        p = pod(f"bert-{k}", 2, namespace="ml", node_name=node, phase="Running")
        p["metadata"]["labels"][NAME_LABEL] = "bert"
        p["metadata"]["annotations"] = placement_annotations(Placement("x", node, (card,), 250))
        server.put("/api/v1", "pods", p)
    server.put("/api/v1", "pods", pod("other", 1, namespace="ml"))  # not ours
    live = server.get("/apis/apps/v1", "deployments", "ml", "bert")
    live["status"] = {"readyReplicas": 2, "updatedReplicas": 2}
    status = await reconcile(api, cr)
    assert status["readyReplicas"] == 2 and status["phase"] == "Ready"
    assert status["placements"] == [
        {"pod": "bert-0", "node": "a100-1", "cards": [0], "phase": "Running"},
        {"pod": "bert-1", "node": "a100-2", "cards": [3], "phase": "Running"},
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": ""}, "spec.model"),
        ({"octants": 12}, "multiple of 8"),
        ({"octants": "two"}, "spec.octants"),
        ({"bogus": 1}, "unknown spec field"),
        ({"targetQPS": 100.0}, "not both"),
        ({"octants": "auto"}, "need the model repository"),
    ],
)
async def test_bad_specs_are_refused_with_the_field(
    cluster: tuple[FakeApiServer, KubeClient], spec: dict[str, Any], message: str
) -> None:
    server, api = cluster
    cr = server.put(CR_PREFIX, PLURAL, inference(**spec))
    with pytest.raises(InvalidSpecError, match=message):
        await reconcile(api, cr)
    assert not server.sent("POST")


async def test_auto_size_from_the_models_footprint(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, api = cluster

    def footprint(model: str) -> ModelFootprint:
        if model != "bert":
            raise NotFoundError(model)
        return ModelFootprint(
            weights_bytes=20_000 * 2**20, bytes_per_sample=2**20, max_batch=64, samples_per_second_per_card=400.0
        )

    cr = server.put(CR_PREFIX, PLURAL, inference(octants="auto", replicas=None, targetQPS=300.0, sloMs=50.0))
    del cr["spec"]["replicas"]
    status = await reconcile(api, cr, footprint)
    (create,) = server.sent("POST", "/deployments")
    template = create.body["spec"]["template"]
    memory = int(template["metadata"]["annotations"]["octacloud.io/gpu-memory-mib"])
    assert memory == footprint("bert").memory_mib
    octants = int(template["spec"]["containers"][0]["resources"]["limits"][OCTANTS])
    assert octants == status["octants"] and octants * 81_920 >= memory * 8  # fits its share of an A100
    assert status["replicas"] >= 1


async def test_kopf_handlers_patch_status(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, _ = cluster
    registry = kopf.OperatorRegistry()
    register_handlers(lambda: KubeClient("https://k8s", transport=server.transport), registry=registry)
    handlers = list(registry._changing.get_all_handlers())  # create, update, resume
    assert len(handlers) == 3 and len(list(registry._spawning.get_all_handlers())) == 1  # and the timer
    on_change: Any = handlers[0].fn  # kopf passes body, patch and more by keyword
    cr = server.put(CR_PREFIX, PLURAL, inference())
    patch = kopf.Patch()
    await on_change(body=cr, patch=patch)
    assert patch["status"]["replicas"] == 3
    assert server.sent("POST", "/deployments")
    bad = inference("bad", octants=0)
    with pytest.raises(kopf.PermanentError, match="octants must be >= 1"):
        await on_change(body=bad, patch=(p := kopf.Patch()))
    assert p["status"]["phase"] == "Invalid"
    assert resource_path("ml", "bert", "status") == f"{CR_PREFIX}/namespaces/ml/{PLURAL}/bert/status"


async def test_two_tenants_and_a_foreign_deployment(cluster: tuple[FakeApiServer, KubeClient]) -> None:
    server, api = cluster
    mine = server.put(CR_PREFIX, PLURAL, inference())
    theirs = inference(tenant="globex")
    theirs["metadata"]["namespace"] = "other"
    theirs = server.put(CR_PREFIX, PLURAL, theirs)
    await reconcile(api, mine)
    await reconcile(api, theirs)
    a = server.get("/apis/apps/v1", "deployments", "ml", "bert")
    b = server.get("/apis/apps/v1", "deployments", "other", "bert")
    assert a["spec"]["template"]["metadata"]["labels"]["octacloud.io/tenant"] == "acme"
    assert b["spec"]["template"]["metadata"]["labels"]["octacloud.io/tenant"] == "globex"
    # someone's own Deployment of the same name is never taken over
    server.put(
        "/apis/apps/v1", "deployments", {"metadata": {"name": "web", "namespace": "ml"}, "spec": {"replicas": 9}}
    )
    web = server.put(CR_PREFIX, PLURAL, inference("web"))
    with pytest.raises(InvalidSpecError, match="does not belong to InferenceDeployment web"):
        await reconcile(api, web)
    assert server.get("/apis/apps/v1", "deployments", "ml", "web")["spec"] == {"replicas": 9}
    assert not server.sent("PATCH", "/deployments/web")


async def test_a_model_the_repository_lacks_is_a_condition_and_asked_again(
    cluster: tuple[FakeApiServer, KubeClient],
) -> None:
    server, _ = cluster

    def footprint(model: str) -> ModelFootprint:
        raise NotFoundError(f"model {model!r} is not in the model storage file:///repo")

    registry = kopf.OperatorRegistry()
    register_handlers(lambda: KubeClient("https://k8s", transport=server.transport), footprint, registry=registry)
    on_change: Any = next(iter(registry._changing.get_all_handlers())).fn
    with pytest.raises(kopf.TemporaryError, match="'bert' is not in the model storage"):  # retried, not given up
        await on_change(body=inference(), patch=(p := kopf.Patch()))
    (valid, ready) = p["status"]["conditions"]
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "False", "ModelNotFound")
    assert "bert" in valid["message"] and ready["status"] == "False"
    assert not server.sent("POST", "/deployments")
    with pytest.raises(kopf.PermanentError):
        await on_change(body=inference("bad", octants=0), patch=(q := kopf.Patch()))
    assert q["status"]["conditions"][0]["reason"] == "InvalidSpec"
