"""Wire fixtures: the JSON kube-scheduler and the API server send, built as the upstream types serialise.

``k8s.io/kube-scheduler/extender/v1`` types carry no JSON tags, so Go's encoder writes the field names as they are
(``Pod``, ``NodeNames``, ``FailedNodes``, ``PodUID``...); ``v1.Pod`` and ``v1.Node`` use their lowerCamel tags.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from octacloud.core.model import Node
from octacloud.k8s.resources import OCTANTS, node_cards

Obj = dict[str, Any]


def pod(
    name: str,
    octants: int | None = None,
    *,
    gpus: int | None = None,
    namespace: str = "default",
    uid: str | None = None,
    priority: int = 0,
    tenant: str = "",
    annotations: dict[str, str] | None = None,
    node_name: str = "",
    phase: str = "Pending",
) -> Obj:
    """A ``v1.Pod`` as kube-scheduler sends it in ``ExtenderArgs.Pod``."""
    limits: Obj = {"cpu": "500m", "memory": "1Gi"}
    if octants is not None:
        limits[OCTANTS] = str(octants)
    if gpus is not None:
        limits["octacloud.io/gpus"] = str(gpus)
    spec: Obj = {
        "containers": [
            {
                "name": "model",
                "image": "octacloud/replica:0.1",
                "resources": {"limits": limits, "requests": dict(limits)},
            }
        ],
        "schedulerName": "default-scheduler",
        "priority": priority,
        "restartPolicy": "Always",
    }
    if node_name:
        spec["nodeName"] = node_name
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "resourceVersion": "1",
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": {"octacloud.io/tenant": tenant} if tenant else {},
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": phase, "qosClass": "Guaranteed"},
    }


def node_obj(node: Node) -> Obj:
    """A ``v1.Node`` as the API server returns it, labelled by octacloud's device plugin."""
    cards = node_cards(node)
    capacity = {
        "cpu": str(node.cpu_milli // 1000),
        "memory": f"{node.memory_mib}Mi",
        "pods": "110",
        OCTANTS: str(node.gpu_count * 8),
        "octacloud.io/gpus": str(node.gpu_count),
    }
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": node.name,
            "uid": str(uuid.uuid4()),
            "labels": {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", **cards.labels()},
            "annotations": cards.annotations(),
        },
        "spec": {"podCIDR": "10.244.0.0/24"},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def args_names(p: Obj, names: list[str]) -> Obj:
    """``ExtenderArgs`` with nodeCacheCapable: true."""
    return {"Pod": p, "Nodes": None, "NodeNames": names}


def args_nodes(p: Obj, nodes: list[Obj]) -> Obj:
    """``ExtenderArgs`` with nodeCacheCapable: false (a ``v1.NodeList``)."""
    node_list = {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": nodes}
    return {"Pod": p, "Nodes": node_list, "NodeNames": None}


def binding(p: Obj, node: str) -> Obj:
    meta = p["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()
