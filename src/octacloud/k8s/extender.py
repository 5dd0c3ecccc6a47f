"""kube-scheduler's HTTP extender, answered by octacloud's scheduler.

kube-scheduler POSTs JSON to ``<urlPrefix>/<verb>`` (the types of ``k8s.io/kube-scheduler/extender/v1``, encoded by
Go's ``encoding/json`` without tags, so the keys are the Go field names: ``Pod``, ``Nodes``, ``NodeNames``; Go
decodes them case-insensitively, and so does this extender):

- ``filter`` (``ExtenderArgs`` → ``ExtenderFilterResult``): octacloud decides the pod's node and card(s) among the
  candidates, exactly as ``octacloud up`` does with the same profile, and returns that one node (the others are
  left out: kube-scheduler neither preempts nor explains when a node passes). When the pod fits nowhere, every
  candidate comes back in ``FailedNodes`` with its reason (``FailedAndUnresolvableNodes`` when no preemption could
  make the pod fit there). The decision is *assumed* (held in the state) until the pod is bound, so the next
  pod's filter sees it, and expires if no bind follows;
- ``prioritize`` (``ExtenderArgs`` → ``HostPriorityList``): 10 (``MaxExtenderPriority``) for octacloud's node, 0 for
  the others;
- ``bind`` (``ExtenderBindingArgs`` → ``ExtenderBindingResult``): writes the placement on the pod (annotations),
  then creates its ``Binding``. If kube-scheduler chose another node, octacloud places the pod there or refuses;
- ``preempt`` (``ExtenderPreemptionArgs`` → ``ExtenderPreemptionResult``): keeps the nodes where evicting
  kube-scheduler's proposed victims lets octacloud place the pod, each with the fewest of those victims needed.

Bad input (not JSON, missing fields, a node octacloud does not know, a malformed pod) gets an answer whose
``Error`` says what was wrong, and the extender keeps serving. On start, and every ``resync_s``, the state is
rebuilt from the pods' annotations (:meth:`Extender.resync`), so a restart loses nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from octacloud.core.clock import Clock, SystemClock
from octacloud.core.errors import InvalidSpecError, OctacloudError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import max_model_memory_mib
from octacloud.k8s.api import ApiError, KubeClient, node_path, pods_path
from octacloud.k8s.resources import (
    GPU_COUNT_LABEL,
    Obj,
    node_from_k8s,
    placement_annotations,
    pod_is_active,
    pod_key,
    pod_placement,
    pod_request,
    pod_uid,
)
from octacloud.scheduler.framework.runner import Decision, Profile, Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.framework.transaction import Transaction

log = logging.getLogger("octacloud.k8s.extender")

MAX_EXTENDER_PRIORITY = 10
"""``MaxExtenderPriority`` of ``k8s.io/kube-scheduler/extender/v1``."""


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


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ExtenderError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(slots=True)
class ExtenderSettings:
    assume_ttl_s: float = 120.0
    """A filtered pod's placement is held this long for its bind; then released."""
    resync_s: float = 10.0
    """How often the state is rebuilt from the API's pods (pods that finished give their cards back)."""
    refresh_s: float = 5.0
    """A filter naming a node octacloud does not know re-reads the nodes, at most this often."""
    explain_placed: bool = False
    """When a pod is placed, also list every other candidate in ``FailedNodes`` ("octacloud chose node X")."""


@dataclass(slots=True)
class _Assumed:
    request: Request
    placement: Placement
    expires_at: float


@dataclass
class Extender:
    """octacloud's scheduler behind kube-scheduler. ``api`` may be None (no bind, no resync: tests, benchmarks)."""

    nodes: list[Node]
    profile: Profile
    api: KubeClient | None = None
    clock: Clock = field(default_factory=SystemClock)
    settings: ExtenderSettings = field(default_factory=ExtenderSettings)
    fixed_fleet: bool = False
    """The fleet came from a fleet file: Node objects kube-scheduler sends do not change it."""
    _scheduler: Scheduler = field(init=False)
    _assumed: dict[str, _Assumed] = field(default_factory=dict, init=False)
    _bound: dict[str, Request] = field(default_factory=dict, init=False)
    _next_refresh: float = field(default=float("-inf"), init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    """Held by the HTTP front around each verb and by :meth:`resync`: one change of the state at a time."""

    def __post_init__(self) -> None:
        self._scheduler = Scheduler(ClusterState(self.nodes), self.profile)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @property
    def state(self) -> ClusterState:
        return self._scheduler.state

    # ---- the verbs ---------------------------------------------------------------------------------------

    async def filter(self, args: Any) -> Obj:
        """``ExtenderArgs`` → ``ExtenderFilterResult``."""
        try:
            pod, names, node_objs = await self._args(args)
            request = pod_request(pod)
        except (ExtenderError, InvalidSpecError, ApiError) as exc:
            return {"Error": str(exc)}
        if request is None:  # not octacloud's: no opinion
            return self._filtered(names, node_objs, names, {}, {})
        self._expire()
        self._forget(request.name)
        index = self.state.index
        known = [n for n in names if n in index]
        unresolvable = {n: self._unknown(n) for n in names if n not in index} if len(known) < len(names) else {}
        failed: dict[str, str] = {}
        if request.name in self.state.allocations:  # filtered again after its bind: it stays where it is
            node = self.state.allocations[request.name].placement.node
            failed = {n: f"pod {pod_key(pod)} is bound to node {node}" for n in known if n != node}
            return self._filtered(names, node_objs, [node] if node in known else [], failed, unresolvable)
        everywhere = len(known) == len(self.state) and len(set(known)) == len(known)
        decision = self._scheduler.decide(request, None if everywhere else [index[n] for n in known])
        if decision.placement is not None:
            p = decision.placement
            self._scheduler.commit(decision.request, p)
            self._assumed[request.name] = _Assumed(
                decision.request, p, self.clock.monotonic() + self.settings.assume_ttl_s
            )
            # A node passes, so kube-scheduler will not preempt for this pod and shows no diagnosis: the other
            # nodes are left out (dropped without a reason), which saves encoding a reason per node.
            if self.settings.explain_placed:
                failed = dict.fromkeys(known, f"octacloud chose node {p.node}")
                failed.pop(p.node, None)
            return self._filtered(names, node_objs, [p.node], failed, unresolvable)
        for n in known:
            reason = _why_not(self._scheduler.decide(request, [self.state.index[n]]), pod)
            if self._never_fits(request, self.state.nodes[self.state.index[n]]):
                unresolvable[n] = reason
            else:
                failed[n] = reason
        return self._filtered(names, node_objs, [], failed, unresolvable)

    async def prioritize(self, args: Any) -> list[Obj]:
        """``ExtenderArgs`` → ``HostPriorityList``; raises :class:`ExtenderError` on bad input (no Error field)."""
        try:
            pod, names, _ = await self._args(args)
            request = pod_request(pod)
        except (InvalidSpecError, ApiError) as exc:
            raise ExtenderError(str(exc)) from None
        chosen: str | None = None
        if request is not None:
            self._expire()
            held = self._assumed.get(request.name)
            if held is not None:
                chosen = held.placement.node
            elif request.name in self._bound:
                chosen = self.state.allocations[request.name].placement.node
            else:
                known = [self.state.index[n] for n in names if n in self.state.index]
                decision = self._scheduler.decide(request, known)
                chosen = decision.placement.node if decision.placement is not None else None
        return [{"Host": n, "Score": MAX_EXTENDER_PRIORITY if n == chosen else 0} for n in names]

    async def bind(self, args: Any) -> Obj:
        """``ExtenderBindingArgs`` → ``ExtenderBindingResult``: annotate the pod, then bind it."""
        try:
            a = _object(args, "ExtenderBindingArgs")
            name, namespace, uid, node = (field_of(a, k) for k in ("PodName", "PodNamespace", "PodUID", "Node"))
            for key, value in (("PodName", name), ("PodNamespace", namespace), ("Node", node)):
                if not isinstance(value, str) or not value:
                    raise ExtenderError(f"ExtenderBindingArgs.{key}: expected a non-empty string, got {value!r}")
            if self.api is None:
                raise ExtenderError("this extender has no Kubernetes API client; it cannot bind")
            pod = await self.api.get(f"{pods_path(namespace)}/{name}")
            if uid and pod_uid(pod) != uid:
                raise ExtenderError(f"pod {namespace}/{name} has UID {pod_uid(pod)}, the binding names {uid}")
            request = pod_request(pod)
            placement = None if request is None else self._placement_for(request, str(node), pod)
            if placement is not None:
                annotations = placement_annotations(placement)
                await self.api.patch(f"{pods_path(namespace)}/{name}", {"metadata": {"annotations": annotations}})
            try:
                await self.api.bind(str(namespace), str(name), str(uid or ""), str(node))
            except ApiError:
                if request is not None:
                    self._forget(request.name)
                raise
        except (ExtenderError, InvalidSpecError, ApiError) as exc:
            return {"Error": str(exc)}
        if request is not None and placement is not None:
            self._assumed.pop(request.name, None)
            self._bound[request.name] = self.state.allocations[request.name].request
            log.info("bound %s/%s to %s cards %s", namespace, name, node, list(placement.gpus))
        return {"Error": ""}

    async def preempt(self, args: Any) -> Obj:
        """``ExtenderPreemptionArgs`` → ``ExtenderPreemptionResult``; raises :class:`ExtenderError` on bad input."""
        try:
            a = _object(args, "ExtenderPreemptionArgs")
            pod = _object(field_of(a, "Pod"), "ExtenderPreemptionArgs.Pod")
            request = pod_request(pod)
        except InvalidSpecError as exc:
            raise ExtenderError(str(exc)) from None
        meta = field_of(a, "NodeNameToMetaVictims")
        full = field_of(a, "NodeNameToVictims")
        proposals: dict[str, list[str]] = {}
        pdb: dict[str, int] = {}
        source, uid_of = (meta, _meta_uid) if meta is not None else (full, _pod_uid_of)
        for node, victims in _object(source or {}, "ExtenderPreemptionArgs.NodeNameToMetaVictims").items():
            v = _object(victims or {}, f"victims on node {node}")
            pods = field_of(v, "Pods") or []
            if not isinstance(pods, list):
                raise ExtenderError(f"victims on node {node}: Pods must be a list")
            proposals[node] = [uid_of(p, node) for p in pods]
            pdb[node] = int(field_of(v, "NumPDBViolations") or 0)
        if request is None:  # not octacloud's: keep kube-scheduler's proposal
            kept = proposals
        else:
            self._expire()
            self._forget(request.name)
            kept = {}
            for node, victims in proposals.items():
                needed = self._victims_needed(request, node, victims)
                if needed is not None:
                    kept[node] = needed
        return {
            "NodeNameToMetaVictims": {
                node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb.get(node, 0)}
                for node, uids in kept.items()
            }
        }

    # ---- state from the API ------------------------------------------------------------------------------

    async def resync(self) -> None:
        """Rebuild the state from the API: the nodes octacloud's device plugin labelled, and every active pod
        with a placement annotation; assumed (filtered, not yet bound) placements are kept."""
        if self.api is None:
            return
        async with self.lock:
            await self._resync(self.api)

    async def _resync(self, api: KubeClient) -> None:
        if not self.fixed_fleet:
            self._set_nodes(await self._api_nodes())
        pods = await api.list(pods_path())
        state = ClusterState(self.state.nodes)
        scheduler = Scheduler(state, self.profile)
        bound: dict[str, Request] = {}
        for pod in pods:
            try:
                placement = pod_placement(pod)
                request = pod_request(pod) if placement is not None else None
                if placement is None or request is None or not pod_is_active(pod):
                    continue
                placement = dataclasses.replace(placement, milli_per_gpu=request.gpu_milli)
                scheduler.commit(request, placement)
            except (InvalidSpecError, OctacloudError) as exc:
                log.warning("pod %s: cannot account its placement (%s)", pod_key(pod), exc)
                continue
            bound[request.name] = request
        for name, held in list(self._assumed.items()):
            try:
                if name not in bound:
                    scheduler.commit(held.request, held.placement)
            except (InvalidSpecError, OctacloudError):
                del self._assumed[name]
        self._scheduler, self._bound = scheduler, bound

    async def _api_nodes(self) -> list[Node]:
        assert self.api is not None
        out: list[Node] = []
        for obj in await self.api.list(node_path(), label_selector=GPU_COUNT_LABEL):
            try:
                out.append(node_from_k8s(obj))
            except InvalidSpecError as exc:
                log.warning("%s", exc)
        return out or list(self.state.nodes)

    def _set_nodes(self, nodes: Sequence[Node]) -> None:
        """Adopt a new fleet (nodes joined, left, or their cards' health changed), keeping every allocation
        whose node and cards still exist."""
        old = self.state
        if list(old.nodes) == list(nodes):
            return
        healthy = [_healthy(n) for n in nodes]
        state = ClusterState(healthy)
        scheduler = Scheduler(state, self.profile)
        for a in old:
            if a.placement.node in state.index:
                try:
                    scheduler.commit(a.request, a.placement)
                except (InvalidSpecError, OctacloudError):
                    log.warning("pod %s: its cards are gone from node %s", a.request.name, a.placement.node)
                    self._assumed.pop(a.request.name, None)
                    self._bound.pop(a.request.name, None)
        for n in nodes:
            for g in n.gpus:
                if g.health is not Health.HEALTHY:
                    state.set_card_health(n.name, g.index, g.health)
        self._scheduler = scheduler

    # ---- mechanism ---------------------------------------------------------------------------------------

    async def _args(self, args: Any) -> tuple[Mapping[str, Any], list[str], list[Obj] | None]:
        a = _object(args, "ExtenderArgs")
        pod = field_of(a, "Pod")
        if pod is None:
            raise ExtenderError("ExtenderArgs.Pod is missing")
        pod = _object(pod, "ExtenderArgs.Pod")
        names_field, nodes_field = field_of(a, "NodeNames"), field_of(a, "Nodes")
        if names_field is not None:
            if not isinstance(names_field, list) or not all(isinstance(n, str) for n in names_field):
                raise ExtenderError("ExtenderArgs.NodeNames: expected a list of node names")
            names = list(names_field)
            now = self.clock.monotonic()
            if (
                self.api is not None
                and not self.fixed_fleet
                and now >= self._next_refresh
                and any(n not in self.state.index for n in names)
            ):  # a node joined since the last resync (or a node without cards: asked again only after a while)
                self._next_refresh = now + self.settings.refresh_s
                self._set_nodes(await self._api_nodes())
            return pod, names, None
        if nodes_field is not None:
            items = field_of(_object(nodes_field, "ExtenderArgs.Nodes"), "items") or []
            if not isinstance(items, list):
                raise ExtenderError("ExtenderArgs.Nodes.items: expected a list of v1.Node")
            objs = [dict(_object(i, "ExtenderArgs.Nodes.items[]")) for i in items]
            if not self.fixed_fleet:
                self._learn(objs)
            return pod, [str((o.get("metadata") or {}).get("name", "")) for o in objs], objs
        raise ExtenderError("ExtenderArgs has neither NodeNames (nodeCacheCapable) nor Nodes")

    def _learn(self, objs: list[Obj]) -> None:
        """Add or update the nodes kube-scheduler sent (when it is not node-cache capable)."""
        current = {n.name: n for n in self.state.nodes}
        changed = False
        for obj in objs:
            if GPU_COUNT_LABEL not in ((obj.get("metadata") or {}).get("labels") or {}):
                continue
            try:
                node = node_from_k8s(obj)
            except InvalidSpecError as exc:
                log.warning("%s", exc)
                continue
            if current.get(node.name) != node:
                current[node.name], changed = node, True
        if changed:
            self._set_nodes(list(current.values()))

    @staticmethod
    def _filtered(
        names: list[str], objs: list[Obj] | None, keep: list[str], failed: dict[str, str], unresolvable: dict[str, str]
    ) -> Obj:
        result: Obj = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
        if objs is None:
            result["NodeNames"] = keep
        else:
            wanted = set(keep)
            result["Nodes"] = {
                "apiVersion": "v1",
                "kind": "NodeList",
                "metadata": {},
                "items": [o for o in objs if (o.get("metadata") or {}).get("name") in wanted],
            }
        return result

    def _unknown(self, name: str) -> str:
        return (
            f"node {name} is not in octacloud's fleet (no {GPU_COUNT_LABEL} label: is octacloud's device plugin "
            "running there?)"
        )

    @staticmethod
    def _never_fits(request: Request, node: Node) -> bool:
        """True when no eviction could make ``request`` fit on ``node`` (too few or unsuitable cards)."""
        cards = [
            g
            for g in node.gpus
            if g.health is Health.HEALTHY
            and request.allows_model(g.model)
            and max_model_memory_mib(g.memory_mib) >= request.gpu_memory_mib
        ]
        return node.health is not Health.HEALTHY or len(cards) < request.num_gpu

    def _placement_for(self, request: Request, node: str, pod: Mapping[str, Any]) -> Placement:
        """The placement to bind: the assumed one, a recorded one, or a fresh decision on ``node``."""
        held = self._assumed.get(request.name)
        if held is not None and held.placement.node == node:
            return held.placement
        if request.name in self.state.allocations and request.name in self._bound:
            p = self.state.allocations[request.name].placement
            if p.node == node:
                return p
        self._forget(request.name)
        if node not in self.state.index:
            raise ExtenderError(self._unknown(node))
        recorded = pod_placement(pod)
        if recorded is not None and recorded.node == node:
            self._scheduler.commit(request, dataclasses.replace(recorded, milli_per_gpu=request.gpu_milli))
            return self.state.allocations[request.name].placement
        decision = self._scheduler.decide(request, [self.state.index[node]])
        if decision.placement is None:
            raise ExtenderError(f"{_why_not(decision, pod)} on node {node}")
        self._scheduler.commit(decision.request, decision.placement)
        self._assumed[request.name] = _Assumed(
            decision.request, decision.placement, self.clock.monotonic() + self.settings.assume_ttl_s
        )
        return decision.placement

    def _victims_needed(self, request: Request, node: str, victims: list[str]) -> list[str] | None:
        """The fewest of ``victims`` whose eviction lets ``request`` fit on ``node`` (None: none do)."""
        if node not in self.state.index:
            return None
        i = self.state.index[node]
        ours = [v for v in victims if v in self.state.allocations and self.state.allocations[v].node_index == i]
        others = [v for v in victims if v not in ours]
        if not self._fits_without(request, i, ours):
            return None
        # Drop victims one at a time, most important first, while the pod still fits without the rest.
        needed = sorted(ours, key=lambda v: -self.state.allocations[v].request.priority)
        for v in list(needed):
            trial = [u for u in needed if u != v]
            if self._fits_without(request, i, trial):
                needed = trial
        return [*others, *needed]

    def _fits_without(self, request: Request, node: int, victims: list[str]) -> bool:
        with Transaction(self.state) as tx:
            for v in victims:
                tx.evict(v)
            decision = self._scheduler.decide(request, [node])
            tx.rollback()
        return decision.placement is not None

    def _forget(self, name: str) -> None:
        """Drop an assumed placement (a pod filtered again, or whose bind failed)."""
        if self._assumed.pop(name, None) is not None and name in self.state.allocations:
            self.state.release(name)

    def _expire(self) -> None:
        now = self.clock.monotonic()
        for name in [n for n, a in self._assumed.items() if a.expires_at <= now]:
            log.info("pod %s was filtered but never bound: its placement is released", name)
            self._forget(name)

    def forget(self, uid: str) -> None:
        """Give back what pod ``uid`` holds (it was deleted, or never bound); a no-op for an unknown pod."""
        self._assumed.pop(uid, None)
        self._bound.pop(uid, None)
        if uid in self.state.allocations:
            self.state.release(uid)

    def placements(self) -> dict[str, Placement]:
        """Every pod octacloud holds cards for (bound or assumed), by UID."""
        return {a.request.name: a.placement for a in self.state}


def _why_not(decision: Decision, pod: Mapping[str, Any]) -> str:
    parts = ", ".join(f"{why}: {n}" for why, n in sorted(decision.reasons.items(), key=lambda kv: -kv[1]))
    return f"pod {pod_key(pod)} does not fit ({parts or 'no nodes'})"


def _meta_uid(pod: Any, node: str) -> str:
    uid = field_of(_object(pod, f"MetaVictims on node {node}: Pods[]"), "UID")
    if not isinstance(uid, str) or not uid:
        raise ExtenderError(f"MetaVictims on node {node}: a MetaPod needs a UID")
    return uid


def _pod_uid_of(pod: Any, node: str) -> str:
    return pod_uid(_object(pod, f"Victims on node {node}: Pods[]"))


def _healthy(node: Node) -> Node:
    gpus = tuple(dataclasses.replace(g, health=Health.HEALTHY) for g in node.gpus)
    return dataclasses.replace(node, gpus=gpus, health=Health.HEALTHY)
