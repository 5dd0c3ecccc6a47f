"""Failure domains reach a node the same way from every source: fleet file, Kubernetes node, Ray node, node CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from octacloud.control.fleet import parse_fleet
from octacloud.control.ray.inventory import node_from_ray, node_labels, node_resources
from octacloud.core import Gpu, InvalidSpecError, Node
from octacloud.core.domains import (
    POWER_FEED_LABEL,
    RACK_LABEL,
    ZONE_LABEL,
    FailureDomains,
    domain_of,
    domains_of,
    group_by_domain,
)
from octacloud.k8s.resources import node_from_k8s
from octacloud.sim.traces import TraceFormatError, read_nodes


def _fleet(**keys: Any) -> list[Node]:
    return parse_fleet({"nodes": [{"name": "n", "cpu_milli": 1000, "memory_mib": 1024, **keys}]})


def test_fleet_file_domains_become_labels() -> None:
    (node,) = _fleet(zone="eu-1", rack="r12", power_feed="pdu-12a", labels={"team": "vision"})
    assert node.labels == {"team": "vision", ZONE_LABEL: "eu-1", RACK_LABEL: "r12", POWER_FEED_LABEL: "pdu-12a"}
    assert domains_of(node) == FailureDomains("eu-1", "r12", "pdu-12a")
    assert domains_of(node).label() == "eu-1/r12/pdu-12a"


def test_a_label_that_agrees_with_the_key_is_accepted() -> None:
    (node,) = _fleet(rack="r1", labels={RACK_LABEL: "r1"})
    assert domains_of(node).rack == "r1"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"rack": "r1", "labels": {RACK_LABEL: "r2"}}, r"node 'n': rack 'r1' disagrees with label octacloud.io/rack"),
        ({"zone": "a", "labels": {"topology.kubernetes.io/zone": "b"}}, "zone 'a' disagrees"),
        ({"rack": "bad rack"}, r"node 'n': rack: rack 'bad rack' must be 1-63 letters"),
        ({"power_feed": 7}, r"power_feed: power_feed 7 must be"),
        ({"zone": "-a"}, "starting and ending with a letter or digit"),
        ({"zone": "a" * 64}, "must be 1-63"),
    ],
)
def test_bad_domains_in_a_fleet_file_are_refused_naming_node_and_key(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        _fleet(**keys)


def test_undeclared_domains_are_a_domain_of_their_own() -> None:
    nodes = [Node("a", 1, 1, labels={RACK_LABEL: "r1"}), Node("b", 1, 1, labels={RACK_LABEL: "r1"}), Node("c", 1, 1)]
    assert group_by_domain(nodes, "rack") == {"r1": [0, 1], "~c": [2]}
    assert group_by_domain(nodes, "node") == {"a": [0], "b": [1], "c": [2]}
    assert group_by_domain(nodes, "zone") == {"~a": [0], "~b": [1], "~c": [2]}
    assert domain_of(nodes[2], "rack") == "~c" and domains_of(nodes[2]).label() == "-/-/-"
    with pytest.raises(InvalidSpecError, match="unknown failure-domain kind 'row'"):
        group_by_domain(nodes, "row")


def test_kubernetes_well_known_topology_labels_are_read() -> None:
    obj = {
        "metadata": {
            "name": "k1",
            "labels": {"topology.kubernetes.io/zone": "eu-1b", "topology.kubernetes.io/rack": "r3"},
        },
        "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}},
    }
    assert domains_of(node_from_k8s(obj)) == FailureDomains("eu-1b", "r3", "")
    obj["metadata"]["labels"][RACK_LABEL] = "own-r3"  # type: ignore[index]
    assert domains_of(node_from_k8s(obj)).rack == "own-r3", "octacloud's own label wins over the well-known one"


def _ray_entry(node: Node, extra: dict[str, float] | None = None, labels: bool = True) -> dict[str, Any]:
    resources = {"CPU": 8.0, "memory": float(2**30), **node_resources(node), **(extra or {})}
    return {"NodeID": "x", "Alive": True, "Resources": resources, "Labels": node_labels(node) if labels else {}}


def test_ray_nodes_carry_domains_as_labels_or_marker_resources() -> None:
    gpus = (Gpu(0, "T4", 16384),)
    (node,) = _fleet(zone="z1", rack="r1", power_feed="f1", gpus=[{"model": "T4", "memory_mib": 16384}])
    back = node_from_ray(_ray_entry(node))
    assert back is not None and domains_of(back) == FailureDomains("z1", "r1", "f1")

    bare = Node("bare", 8000, 1024, gpus)
    markers = {"octacloud_rack:r7": 1.0, "octacloud_power_feed:f3": 1.0}
    got = node_from_ray(_ray_entry(bare, markers))
    assert got is not None and domains_of(got) == FailureDomains("", "r7", "f3")

    labelled = node_from_ray(_ray_entry(node, {"octacloud_rack:r9": 1.0}))
    assert labelled is not None and domains_of(labelled).rack == "r1", "a label wins over a marker"

    with pytest.raises(InvalidSpecError, match=r"Ray node 'bare': more than one octacloud_rack:<name> resource"):
        node_from_ray(_ray_entry(bare, {"octacloud_rack:r1": 1.0, "octacloud_rack:r2": 1.0}))
    with pytest.raises(InvalidSpecError, match=r"Ray node 'bare': octacloud_zone:: zone 'a b' must be"):
        node_from_ray(_ray_entry(bare, {"octacloud_zone:a b": 1.0}))


def test_node_csv_domain_columns(tmp_path: Path) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text(
        "sn,cpu_milli,memory_mib,gpu,model,zone,rack,power_feed\na,1000,1024,1,T4,z0,r0,f0\nb,1000,1024,1,T4,,,\n"
    )
    a, b = read_nodes(path)
    assert domains_of(a) == FailureDomains("z0", "r0", "f0")
    assert domains_of(b) == FailureDomains() and not b.labels
    path.write_text("sn,cpu_milli,memory_mib,gpu,model,rack\na,1000,1024,1,T4,r 0\n")
    with pytest.raises(TraceFormatError, match=r"nodes.csv.*line 2.*rack"):
        read_nodes(path)
