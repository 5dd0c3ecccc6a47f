"""The JSON of kube-scheduler's extender verbs (``k8s.io/kube-scheduler/extender/v1``), read and written.

Those Go types have no JSON tags: the keys are the Go field names (``Pod``, ``Nodes``, ``NodeNames``,
``NodeNameToMetaVictims``, ``FailedNodes``...), and Go decodes them case-insensitively, so :func:`field_of` does
too. The ``Pod`` and ``Node`` objects inside are the API's own JSON (lowerCamel keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from octacloud.core.errors import OctacloudError
from octacloud.core.model import Request
from octacloud.core.units import max_model_memory_mib
from octacloud.k8s.resources import Obj, pod_key, pod_uid
from octacloud.scheduler.framework.runner import Decision
from octacloud.scheduler.framework.state import ClusterState


class ExtenderError(OctacloudError):
    """A request the extender cannot answer; the message goes into the reply's ``Error``."""


def field_of(obj: Mapping[str, Any], name: str) -> Any:
    """``obj[name]`` matched as Go's ``encoding/json`` does: the exact key first, else case-insensitively."""
    if name in obj:
        return obj[name]
    lower = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lower:
            return value
    return None


def expect_object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ExtenderError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """``ExtenderArgs``: the pod and its candidate nodes, by name (nodeCacheCapable) or as ``v1.Node`` objects."""

    pod: Mapping[str, Any]
    names: list[str]
    nodes: list[Obj] | None
    """The ``v1.NodeList`` items when kube-scheduler sent them (not nodeCacheCapable); None for names only."""


def read_args(args: Any) -> ExtenderArgs:
    a = expect_object(args, "ExtenderArgs")
    pod = field_of(a, "Pod")
    if pod is None:
        raise ExtenderError("ExtenderArgs.Pod is missing")
    pod = expect_object(pod, "ExtenderArgs.Pod")
    names_field, nodes_field = field_of(a, "NodeNames"), field_of(a, "Nodes")
    if names_field is not None:
        if not isinstance(names_field, list) or not all(isinstance(n, str) for n in names_field):
            raise ExtenderError("ExtenderArgs.NodeNames: expected a list of node names")
        return ExtenderArgs(pod, list(names_field), None)
    if nodes_field is not None:
        items = field_of(expect_object(nodes_field, "ExtenderArgs.Nodes"), "items") or []
        if not isinstance(items, list):
            raise ExtenderError("ExtenderArgs.Nodes.items: expected a list of v1.Node")
        objs = [dict(expect_object(i, "ExtenderArgs.Nodes.items[]")) for i in items]
        return ExtenderArgs(pod, [str((o.get("metadata") or {}).get("name", "")) for o in objs], objs)
    raise ExtenderError("ExtenderArgs has neither NodeNames (nodeCacheCapable) nor Nodes")


def filter_result(args: ExtenderArgs, keep: list[str], failed: dict[str, str], unresolvable: dict[str, str]) -> Obj:
    """``ExtenderFilterResult`` in the form the arguments came in (names, or the node objects as sent)."""
    result: Obj = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
    if args.nodes is None:
        result["NodeNames"] = keep
    else:
        wanted = set(keep)
        result["Nodes"] = {
            "apiVersion": "v1",
            "kind": "NodeList",
            "metadata": {},
            "items": [o for o in args.nodes if (o.get("metadata") or {}).get("name") in wanted],
        }
    return result


@dataclass(frozen=True, slots=True)
class Proposal:
    """kube-scheduler's victims on one node (``MetaVictims`` or ``Victims``), by pod UID."""

    victims: list[str]
    pdb_violations: int


def read_preemption(args: Any) -> tuple[Mapping[str, Any], dict[str, Proposal]]:
    """``ExtenderPreemptionArgs`` → (the pod, its victims by node)."""
    a = expect_object(args, "ExtenderPreemptionArgs")
    pod = expect_object(field_of(a, "Pod"), "ExtenderPreemptionArgs.Pod")
    meta = field_of(a, "NodeNameToMetaVictims")
    source = meta if meta is not None else field_of(a, "NodeNameToVictims")
    proposals: dict[str, Proposal] = {}
    for node, victims in expect_object(source or {}, "ExtenderPreemptionArgs.NodeNameToMetaVictims").items():
        v = expect_object(victims or {}, f"victims on node {node}")
        pods = field_of(v, "Pods") or []
        if not isinstance(pods, list):
            raise ExtenderError(f"victims on node {node}: Pods must be a list")
        uids = [_meta_uid(p, node) if meta is not None else _pod_uid_of(p, node) for p in pods]
        proposals[node] = Proposal(uids, int(field_of(v, "NumPDBViolations") or 0))
    return pod, proposals


def preemption_result(kept: Mapping[str, Proposal]) -> Obj:
    """``ExtenderPreemptionResult``: the nodes kept, each with its victims as ``MetaPod`` UIDs."""
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in p.victims], "NumPDBViolations": p.pdb_violations}
            for node, p in kept.items()
        }
    }


def why_not(decision: Decision, pod: Mapping[str, Any]) -> str:
    """Why a pod fits nowhere among the nodes decided on (the reason kube-scheduler shows in its event)."""
    ranked = sorted(decision.reasons.items(), key=lambda kv: -kv[1])
    parts = ", ".join(why if n == 1 else f"{why}: {n} nodes" for why, n in ranked)
    return f"pod {pod_key(pod)} does not fit ({parts or 'no nodes'})"


def shortfall(request: Request, state: ClusterState, name: str) -> str:
    """What ``request`` asks for and what node ``name`` has of it: the part of the reason a user acts on."""
    i = state.index[name]
    node = state.nodes[i]
    asks = f"{request.num_gpu} card(s) x {request.gpu_milli} milli-GPU"
    if request.gpu_models:
        asks += f" of {'/'.join(sorted(request.gpu_models))}"
    if request.gpu_memory_mib:
        asks += f" with {request.gpu_memory_mib} MiB"
    suitable = [
        g.index
        for g in node.gpus
        if state.card_usable(i, g.index)
        and request.allows_model(g.model)
        and max_model_memory_mib(g.memory_mib) >= request.gpu_memory_mib
    ]
    room = sum(1 for g in suitable if state.free_gpu[i][g] >= request.gpu_milli)
    models = "/".join(sorted({g.model for g in node.gpus})) or "no"
    has = f"{len(node.gpus)} {models} card(s), {len(suitable)} suitable, {room} with room"
    return f"asks for {asks}; node {name} has {has}"


def _meta_uid(pod: Any, node: str) -> str:
    uid = field_of(expect_object(pod, f"MetaVictims on node {node}: Pods[]"), "UID")
    if not isinstance(uid, str) or not uid:
        raise ExtenderError(f"MetaVictims on node {node}: a MetaPod needs a UID")
    return uid


def _pod_uid_of(pod: Any, node: str) -> str:
    return pod_uid(expect_object(pod, f"Victims on node {node}: Pods[]"))
