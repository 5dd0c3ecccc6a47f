"""The scheduler extender against kube-scheduler's wire format (k8s.io/kube-scheduler/extender/v1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from octacloud.app import Cloud, CloudConfig
from octacloud.control.deployments import DeploymentSpec
from octacloud.control.launcher import Launched, LaunchSpec, ReplicaAddress
from octacloud.core.clock import ManualClock
from octacloud.k8s.api import KubeClient
from octacloud.k8s.extender import Extender
from octacloud.k8s.fakeapi import FakeApiServer
from octacloud.k8s.resources import CARDS_ANNOTATION, MILLI_ANNOTATION, NODE_ANNOTATION
from octacloud.scheduler.policies import cloud_profile

from .conftest import fleet
from .wire import args_names, args_nodes, binding, node_obj, pod

NAMES = [n.name for n in fleet()]


def add_pod(server: FakeApiServer, p: dict[str, Any]) -> dict[str, Any]:
    return server.put("/api/v1", "pods", p)


async def schedule(http: httpx.AsyncClient, server: FakeApiServer, p: dict[str, Any]) -> tuple[str, list[int]]:
    """One scheduling cycle as kube-scheduler runs it: filter, prioritize, bind. Returns (node, cards)."""
    add_pod(server, p)
    filtered = (await http.post("/filter", json=args_names(p, NAMES))).json()
    assert filtered["Error"] == "", filtered
    assert len(filtered["NodeNames"]) == 1, filtered
    scores = (await http.post("/prioritize", json=args_names(p, filtered["NodeNames"]))).json()
    best = max(scores, key=lambda h: h["Score"])["Host"]
    bound = (await http.post("/bind", json=binding(p, best))).json()
    assert bound == {"Error": ""}
    stored = server.get("/api/v1", "pods", p["metadata"]["namespace"], p["metadata"]["name"])
    assert stored["spec"]["nodeName"] == best
    ann = stored["metadata"]["annotations"]
    assert ann[NODE_ANNOTATION] == best
    return best, [int(c) for c in ann[CARDS_ANNOTATION].split(",")]


async def test_filter_prioritize_bind_on_the_wire(http: httpx.AsyncClient, api_server: FakeApiServer) -> None:
    p = pod("share", 3)
    add_pod(api_server, p)
    raw = json.dumps(args_names(p, NAMES))
    r = await http.post("/filter", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    result = r.json()
    assert set(result) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    (node,) = result["NodeNames"]
    assert result["FailedNodes"] == result["FailedAndUnresolvableNodes"] == {}  # left out: no diagnosis needed
    scores = (await http.post("/prioritize", json=args_names(p, NAMES))).json()
    assert scores == [{"Host": n, "Score": 10 if n == node else 0} for n in NAMES]
    assert (await http.post("/bind", json=binding(p, node))).json() == {"Error": ""}
    patch, bind = api_server.sent("PATCH", "/pods/share"), api_server.sent("POST", "/pods/share/binding")
    assert len(patch) == 1 and len(bind) == 1
    assert api_server.requests.index(patch[0]) < api_server.requests.index(bind[0])  # annotate first
    assert patch[0].content_type == "application/merge-patch+json"
    ann = patch[0].body["metadata"]["annotations"]
    assert ann[NODE_ANNOTATION] == node and ann[MILLI_ANNOTATION] == "375"
    assert bind[0].body == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "share", "namespace": "default", "uid": p["metadata"]["uid"]},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


async def test_explain_placed_lists_the_other_nodes(extender: Extender) -> None:
    extender.settings.explain_placed = True
    result = await extender.filter(args_names(pod("p", 2), NAMES))
    (node,) = result["NodeNames"]
    assert result["FailedNodes"] == {n: f"octacloud chose node {node}" for n in NAMES if n != node}


async def test_node_list_mode_returns_a_node_list(http: httpx.AsyncClient, extender: Extender) -> None:
    nodes = [node_obj(n) for n in fleet()]
    p = pod("p", gpus=2)
    result = (await http.post("/filter", json=args_nodes(p, nodes))).json()
    assert result["Error"] == ""
    assert result["Nodes"]["kind"] == "NodeList"
    (chosen,) = result["Nodes"]["items"]
    assert chosen == nodes[NAMES.index(chosen["metadata"]["name"])]  # the node object as sent
    placement = extender.placements()[p["metadata"]["uid"]]
    assert chosen["metadata"]["name"] == placement.node and len(placement.gpus) == 2
    assert "NodeNames" not in result


async def test_go_decodes_keys_case_insensitively(http: httpx.AsyncClient) -> None:
    result = (await http.post("/filter", json={"pod": pod("p", 1), "nodenames": NAMES})).json()
    assert result["Error"] == "" and len(result["NodeNames"]) == 1


async def test_pods_without_octacloud_resources_pass_through(http: httpx.AsyncClient) -> None:
    result = (await http.post("/filter", json=args_names(pod("web"), NAMES))).json()
    assert result["NodeNames"] == NAMES and result["FailedNodes"] == {}
    scores = (await http.post("/prioritize", json=args_names(pod("web"), NAMES))).json()
    assert {s["Score"] for s in scores} == {0}


async def test_decisions_equal_octacloud_up(tmp_path: Path, http: httpx.AsyncClient, api_server: FakeApiServer) -> None:
    """Same fleet, same request sequence: the extender places every pod where `octacloud up` puts the replica."""
    sizes = [1, 2, 8, 3, 16, 4, 1, 5, 8, 2, 6, 7, 1, 24, 3, 2, 4, 1, 8, 2]
    ours = [await schedule(http, api_server, pod(f"p{k}", s)) for k, s in enumerate(sizes)]

    class Launcher:
        def launch(self, spec: LaunchSpec) -> Launched:
            return Launched(spec.replica_id, ReplicaAddress("127.0.0.1", 1, 2, 3))

        def address(self, handle: str) -> ReplicaAddress | None:
            return None

        def alive(self, handle: str) -> bool:
            return True

        def stop(self, handle: str, grace: float = 5.0) -> None:
            pass

        def handles(self) -> None:
            return None

    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)  # one published version
    cloud = Cloud(
        CloudConfig(repository=tmp_path / "repo", state_dir=tmp_path / "state"),
        nodes=fleet(),
        launcher=Launcher(),
        clock=ManualClock(),
    )
    theirs = []
    for k, s in enumerate(sizes):
        cloud.controller.deploy(DeploymentSpec(f"d{k}", "m", octants=s, tenant="admin"))
        await cloud.controller.reconcile()
        (r,) = cloud.store.replicas(f"d{k}")
        theirs.append((r.node, list(r.gpus)))
    assert ours == theirs
    assert len({n for n, _ in ours}) >= 2  # the sequence exercises more than one node


BAD: list[tuple[str, bytes, str]] = [
    ("/filter", b"{not json", "not JSON"),
    ("/filter", b"", "not JSON"),
    ("/filter", b"[1, 2]", "ExtenderArgs: expected a JSON object"),
    ("/filter", b'{"NodeNames": ["a100-1"]}', "ExtenderArgs.Pod is missing"),
    ("/filter", json.dumps({"Pod": pod("p", 1)}).encode(), "neither NodeNames"),
    ("/filter", json.dumps({"Pod": pod("p", 1), "NodeNames": "a100-1"}).encode(), "list of node names"),
    ("/filter", json.dumps(args_names({"metadata": {"name": "x"}, "spec": {}}, NAMES)).encode(), "containers"),
    ("/filter", json.dumps(args_names(pod("p", 12), NAMES)).encode(), "spans more than one card"),
    ("/filter", json.dumps(args_names(pod("p", 2, gpus=1), NAMES)).encode(), "not both"),
    (
        "/filter",
        json.dumps(
            args_names(
                pod("p", None, annotations=None)
                | {"spec": {"containers": [{"name": "c", "resources": {"limits": {"octacloud.io/octants": "two"}}}]}},
                NAMES,
            )
        ).encode(),
        "'two'",
    ),
    ("/bind", b'{"PodName": "p", "PodNamespace": "default"}', "ExtenderBindingArgs.Node"),
    ("/bind", b'{"PodName": "ghost", "PodNamespace": "default", "PodUID": "u", "Node": "a100-1"}', "not found"),
]


@pytest.mark.parametrize(("verb", "raw", "message"), BAD)
async def test_bad_requests_get_an_error_and_the_extender_keeps_serving(
    http: httpx.AsyncClient, api_server: FakeApiServer, verb: str, raw: bytes, message: str
) -> None:
    r = await http.post(verb, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert message in r.json()["Error"]
    assert (await schedule(http, api_server, pod("after", 2)))[0]


@pytest.mark.parametrize("verb", ["/prioritize", "/preempt"])
async def test_verbs_without_an_error_field_answer_400(http: httpx.AsyncClient, verb: str) -> None:
    r = await http.post(verb, content=b"{oops")
    assert r.status_code == 400 and "not JSON" in r.json()["Error"]
    r = await http.post(verb, json={"Pod": pod("p", 9), "NodeNames": NAMES})
    assert r.status_code == 400 and "spans more than one card" in r.json()["Error"]


async def test_unknown_nodes_are_unresolvable(http: httpx.AsyncClient) -> None:
    result = (await http.post("/filter", json=args_names(pod("p", 1), ["ghost-1", "ghost-2"]))).json()
    assert result["NodeNames"] == []
    assert set(result["FailedAndUnresolvableNodes"]) == {"ghost-1", "ghost-2"}
    assert "not in octacloud's fleet" in result["FailedAndUnresolvableNodes"]["ghost-1"]


async def test_a_node_that_joins_is_learnt_from_the_api(http: httpx.AsyncClient, api_server: FakeApiServer) -> None:
    from octacloud.core.model import Gpu, Node

    api_server.put("/api/v1", "nodes", node_obj(Node("h100-9", 64_000, 524_288, (Gpu(0, "H100", 81_920),))))
    p = pod("p", 8, annotations={"octacloud.io/gpu-models": "H100"})
    result = (await http.post("/filter", json=args_names(p, [*NAMES, "h100-9"]))).json()
    assert result["NodeNames"] == ["h100-9"]


async def test_nodes_without_cards_do_not_make_every_filter_list_nodes(
    http: httpx.AsyncClient, api_server: FakeApiServer, clock: ManualClock
) -> None:
    names = [*NAMES, "web-1"]  # kube-scheduler also sends nodes octacloud's device plugin never labelled
    before = len(api_server.sent("GET", "/api/v1/nodes"))  # the fixture's resync
    for k in range(5):
        result = (await http.post("/filter", json=args_names(pod(f"p{k}", 1), names))).json()
        assert "web-1" in result["FailedAndUnresolvableNodes"] or result["NodeNames"]
    assert len(api_server.sent("GET", "/api/v1/nodes")) == before + 1
    clock.advance(10)
    await http.post("/filter", json=args_names(pod("later", 1), names))
    assert len(api_server.sent("GET", "/api/v1/nodes")) == before + 2


async def test_restart_rebuilds_the_state_from_annotations(
    http: httpx.AsyncClient, api_server: FakeApiServer, api: KubeClient, extender: Extender
) -> None:
    for k, s in enumerate([8, 8, 3, 5, 2]):
        await schedule(http, api_server, pod(f"p{k}", s))
    before = extender.placements()
    restarted = Extender(fleet(), cloud_profile(), api=api, clock=ManualClock())  # kill -9, start again
    await restarted.resync()
    assert restarted.placements() == before
    nxt = pod("next", 4)
    a = await extender.filter(args_names(nxt, NAMES))
    b = await restarted.filter(args_names(nxt, NAMES))
    assert a["NodeNames"] == b["NodeNames"]
    assert extender.placements()[nxt["metadata"]["uid"]] == restarted.placements()[nxt["metadata"]["uid"]]


async def test_finished_pods_give_their_cards_back_on_resync(
    http: httpx.AsyncClient, api_server: FakeApiServer, extender: Extender
) -> None:
    p = pod("done", 8)
    await schedule(http, api_server, p)
    assert p["metadata"]["uid"] in extender.placements()
    api_server.get("/api/v1", "pods", "default", "done")["status"]["phase"] = "Succeeded"
    await extender.resync()
    assert p["metadata"]["uid"] not in extender.placements()


async def test_a_filtered_pod_that_is_never_bound_is_released(
    http: httpx.AsyncClient, extender: Extender, clock: ManualClock
) -> None:
    p = pod("lost", 8)
    await http.post("/filter", json=args_names(p, NAMES))
    assert p["metadata"]["uid"] in extender.placements()
    clock.advance(extender.settings.assume_ttl_s + 1)
    await http.post("/filter", json=args_names(pod("other", 1), NAMES))
    assert p["metadata"]["uid"] not in extender.placements()


async def test_filter_twice_holds_one_placement(http: httpx.AsyncClient, extender: Extender) -> None:
    p = pod("again", 8)
    for _ in range(3):
        await http.post("/filter", json=args_names(p, NAMES))
    assert extender.state.allocated_gpu_milli == 1000


async def test_bind_to_another_node_places_there_or_refuses(
    http: httpx.AsyncClient, api_server: FakeApiServer, extender: Extender
) -> None:
    p = add_pod(api_server, pod("elsewhere", 2))
    await http.post("/filter", json=args_names(p, NAMES))
    assert (await http.post("/bind", json=binding(p, "t4-1"))).json() == {"Error": ""}
    assert extender.placements()[p["metadata"]["uid"]].node == "t4-1"
    q = add_pod(api_server, pod("nocard", 1))
    result = (await http.post("/bind", json=binding(q, "cpu-1"))).json()
    assert "does not fit" in result["Error"] and "on node cpu-1" in result["Error"]
    assert q["metadata"]["uid"] not in extender.placements()


async def test_failed_binding_releases_the_cards(
    http: httpx.AsyncClient, api_server: FakeApiServer, extender: Extender
) -> None:
    p = add_pod(api_server, pod("unlucky", 8))
    node = (await http.post("/filter", json=args_names(p, NAMES))).json()["NodeNames"][0]
    api_server.fail[("POST", "/api/v1/namespaces/default/pods/unlucky/binding")] = 500
    result = (await http.post("/bind", json=binding(p, node))).json()
    assert "500" in result["Error"]
    assert p["metadata"]["uid"] not in extender.placements()


async def test_preempt_keeps_the_fewest_victims(
    http: httpx.AsyncClient, api_server: FakeApiServer, extender: Extender
) -> None:
    low = [pod(f"low{k}", 8, priority=0) for k in range(16)]  # 80 %: all normal work may take
    for p in low:
        await schedule(http, api_server, p)
    for k in range(4):  # the failover headroom, taken by work of priority >= 100
        await schedule(http, api_server, pod(f"mid{k}", 8, priority=100))
    high = pod("vip", 8, priority=1000)
    nowhere = (await http.post("/filter", json=args_names(high, NAMES))).json()
    assert nowhere["NodeNames"] == []
    assert set(nowhere["FailedAndUnresolvableNodes"]) == {"cpu-1"}  # no card: preemption cannot help there
    assert set(nowhere["FailedNodes"]) == {"a100-1", "a100-2", "t4-1"}
    assert all("does not fit" in why for why in nowhere["FailedNodes"].values())
    on_node: dict[str, list[str]] = {}
    for p in low:
        on_node.setdefault(extender.placements()[p["metadata"]["uid"]].node, []).append(p["metadata"]["uid"])
    args = {
        "Pod": high,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            n: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": 0} for n, uids in on_node.items()
        },
    }
    result = (await http.post("/preempt", json=args)).json()
    kept = result["NodeNameToMetaVictims"]
    assert kept and all(len(v["Pods"]) == 1 for v in kept.values())  # one whole card frees enough
    assert "t4-1" not in kept or len(kept["t4-1"]["Pods"]) == 1
    assert extender.state.allocated_gpu_milli == 20 * 1000  # nothing was evicted for real
