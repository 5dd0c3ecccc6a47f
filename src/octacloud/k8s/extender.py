"""kube-scheduler's HTTP extender, answered by octacloud's scheduler.

kube-scheduler POSTs JSON to ``<urlPrefix>/<verb>`` (:mod:`~octacloud.k8s.extender_wire` reads and writes it) for
the pods that ask for a managed resource, with the nodes that passed its own filters:

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
- ``preempt`` (``ExtenderPreemptionArgs`` → ``ExtenderPreemptionResult``): for each node kube-scheduler proposes,
  the victims the scheduler's own preemption action chooses there (:func:`~octacloud.scheduler.actions.preempt.
  victims_on_node`: the cheapest set of strictly lower-priority octacloud pods whose eviction lets the pod fit on
  the node's cards), with kube-scheduler's victims that are not octacloud's; nodes where none helps are dropped.

Bad input (not JSON, missing fields, a node octacloud does not know, a malformed pod) gets an answer whose
``Error`` says what was wrong, and the extender keeps serving. The state follows the API: rebuilt from the pods'
annotations on start and every ``resync_s`` (:meth:`Extender.resync`), kept current between by a watch of the
pods (:meth:`Extender.observe`), and rebuilt at once when a pod finds no room while the watch may lag behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from octacloud.core.clock import Clock, SystemClock
from octacloud.core.errors import InvalidSpecError, OctacloudError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import max_model_memory_mib
from octacloud.k8s.api import ApiError, KubeClient, node_path, pods_path
from octacloud.k8s.extender_wire import (
    ExtenderArgs,
    ExtenderError,
    Proposal,
    expect_object,
    field_of,
    filter_result,
    preemption_result,
    read_args,
    read_preemption,
    shortfall,
    why_not,
)
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
from octacloud.scheduler.actions.preempt import victims_on_node
from octacloud.scheduler.framework.runner import Profile, Scheduler
from octacloud.scheduler.framework.state import ClusterState

__all__ = ["MAX_EXTENDER_PRIORITY", "Extender", "ExtenderError", "ExtenderSettings"]

log = logging.getLogger("octacloud.k8s.extender")

MAX_EXTENDER_PRIORITY = 10
"""``MaxExtenderPriority`` of ``k8s.io/kube-scheduler/extender/v1``."""


@dataclass(slots=True)
class ExtenderSettings:
    assume_ttl_s: float = 120.0
    """A filtered pod's placement is held this long for its bind; then released."""
    resync_s: float = 60.0
    """How often the state is rebuilt from the API's pods (the watch keeps it current in between)."""
    refresh_s: float = 5.0
    """A filter naming a node octacloud does not know re-reads the nodes, at most this often."""
    catch_up_s: float = 2.0
    """A pod that finds no room rebuilds the state first (deletions the watch has not brought yet), at most this
    often: kube-scheduler would otherwise preempt for room that is already free."""
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
    calls: Counter[str] = field(default_factory=Counter, init=False)
    """Requests answered, by verb (``filter`` with node objects counts as ``filter-nodes``), and resyncs."""
    _scheduler: Scheduler = field(init=False)
    _assumed: dict[str, _Assumed] = field(default_factory=dict, init=False)
    _bound: dict[str, Request] = field(default_factory=dict, init=False)
    _next_refresh: float = field(default=float("-inf"), init=False)
    _last_resync: float = field(default=float("-inf"), init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    """Held by the HTTP front around each verb, by :meth:`resync` and the watch: one change of the state at a time."""

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
            a = await self._args(args)
            request = pod_request(a.pod)
        except (ExtenderError, InvalidSpecError, ApiError) as exc:
            return {"Error": str(exc)}
        self.calls["filter" if a.nodes is None else "filter-nodes"] += 1
        if request is None:  # not octacloud's: no opinion
            return filter_result(a, a.names, {}, {})
        self._expire()
        self._forget(request.name)
        if request.name in self.state.allocations:  # filtered again after its bind: it stays where it is
            node = self.state.allocations[request.name].placement.node
            elsewhere = {n: f"pod {pod_key(a.pod)} is bound to node {node}" for n in a.names if n != node}
            return filter_result(a, [node] if node in a.names else [], elsewhere, {})
        placement = self._place(request, a.names)
        if placement is None and await self._catch_up():
            placement = self._place(request, a.names)
        index = self.state.index
        unresolvable = {n: self._unknown(n) for n in a.names if n not in index}
        known = [n for n in a.names if n in index]
        failed: dict[str, str] = {}
        if placement is not None:
            # A node passes, so kube-scheduler will not preempt for this pod and shows no diagnosis: the other
            # nodes are left out (dropped without a reason), which saves encoding a reason per node.
            if self.settings.explain_placed:
                failed = {n: f"octacloud chose node {placement.node}" for n in known if n != placement.node}
            return filter_result(a, [placement.node], failed, unresolvable)
        for n in known:
            reason = (
                f"{why_not(self._scheduler.decide(request, [index[n]]), a.pod)}: {shortfall(request, self.state, n)}"
            )
            if self._never_fits(request, self.state.nodes[index[n]]):
                unresolvable[n] = reason
            else:
                failed[n] = reason
        return filter_result(a, [], failed, unresolvable)

    async def prioritize(self, args: Any) -> list[Obj]:
        """``ExtenderArgs`` → ``HostPriorityList``; raises :class:`ExtenderError` on bad input (no Error field)."""
        try:
            a = await self._args(args)
            request = pod_request(a.pod)
        except (InvalidSpecError, ApiError) as exc:
            raise ExtenderError(str(exc)) from None
        self.calls["prioritize"] += 1
        chosen: str | None = None
        if request is not None:
            self._expire()
            held = self._assumed.get(request.name)
            if held is not None:
                chosen = held.placement.node
            elif request.name in self._bound:
                chosen = self.state.allocations[request.name].placement.node
            else:
                known = [self.state.index[n] for n in a.names if n in self.state.index]
                decision = self._scheduler.decide(request, known)
                chosen = decision.placement.node if decision.placement is not None else None
        return [{"Host": n, "Score": MAX_EXTENDER_PRIORITY if n == chosen else 0} for n in a.names]

    async def bind(self, args: Any) -> Obj:
        """``ExtenderBindingArgs`` → ``ExtenderBindingResult``: annotate the pod, then bind it."""
        self.calls["bind"] += 1
        try:
            a = expect_object(args, "ExtenderBindingArgs")
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
            pod, proposals = read_preemption(args)
            request = pod_request(pod)
        except InvalidSpecError as exc:
            raise ExtenderError(str(exc)) from None
        self.calls["preempt"] += 1
        if request is None:  # not octacloud's: keep kube-scheduler's proposal
            return preemption_result(proposals)
        self._expire()
        self._forget(request.name)
        await self._catch_up()
        kept: dict[str, Proposal] = {}
        for node, proposal in proposals.items():
            if node not in self.state.index:
                continue
            ours = victims_on_node(self._scheduler, request, self.state.index[node])
            if ours is None:
                continue
            # kube-scheduler's victims that are not octacloud's were chosen for its own resources (CPU, memory):
            # they stay; of octacloud's pods, the preemption action's choice replaces kube-scheduler's count.
            others = [v for v in proposal.victims if v not in self.state.allocations]
            kept[node] = Proposal([*others, *(a.request.name for a in ours)], proposal.pdb_violations)
        return preemption_result(kept)

    # ---- state from the API ------------------------------------------------------------------------------

    async def resync(self) -> str:
        """Rebuild the state from the API: the nodes octacloud's device plugin labelled, and every active pod
        bound where its placement annotation says; assumed (filtered, not yet bound) placements are kept.
        Returns the resource version of the pod list (where a watch of the pods starts)."""
        if self.api is None:
            return ""
        async with self.lock:
            return await self._resync(self.api)

    async def _resync(self, api: KubeClient) -> str:
        self.calls["resync"] += 1
        self._last_resync = self.clock.monotonic()
        if not self.fixed_fleet:
            self._set_nodes(await self._api_nodes())
        pods, version = await api.list_with_version(pods_path())
        state = ClusterState(self.state.nodes)
        scheduler = Scheduler(state, self.profile)
        bound: dict[str, Request] = {}
        # Pods being deleted still hold their cards, but after every other pod: where a preemptor already took
        # a victim's card, the victim is the one left out.
        for pod in sorted(pods, key=lambda p: bool((p.get("metadata") or {}).get("deletionTimestamp"))):
            request = self._bound_request(pod, scheduler)
            if request is not None:
                bound[request.name] = request
        for name, held in list(self._assumed.items()):
            try:
                if name not in bound:
                    scheduler.commit(held.request, held.placement)
            except (InvalidSpecError, OctacloudError):
                del self._assumed[name]
        self._scheduler, self._bound = scheduler, bound
        return version

    def _bound_request(self, pod: Mapping[str, Any], scheduler: Scheduler) -> Request | None:
        """Account a pod bound where the extender placed it (None: it holds nothing of octacloud's)."""
        try:
            placement = pod_placement(pod)
            if placement is None or not pod_is_active(pod):
                return None
            if (pod.get("spec") or {}).get("nodeName") != placement.node:
                return None  # annotated, but its binding failed or is still to come
            request = pod_request(pod)
            if request is None:
                return None
            scheduler.commit(request, dataclasses.replace(placement, milli_per_gpu=request.gpu_milli))
        except (InvalidSpecError, OctacloudError) as exc:
            log.warning("pod %s: cannot account its placement (%s)", pod_key(pod), exc)
            return None
        return request

    def observe(self, event: str, pod: Mapping[str, Any]) -> None:
        """A watch event of a pod (``ADDED``, ``MODIFIED``, ``DELETED``): a pod deleted or finished gives its cards
        back; one bound with a placement octacloud does not hold (bound while this extender was away) is taken."""
        uid = pod_uid(pod)
        if event == "DELETED" or not pod_is_active(pod):
            if uid in self.state.allocations:
                log.info("pod %s is gone: its cards are free", pod_key(pod))
                self.forget(uid)
            return
        if event in ("ADDED", "MODIFIED") and uid not in self.state.allocations:
            request = self._bound_request(pod, self._scheduler)
            if request is not None:
                self._bound[request.name] = request

    async def _catch_up(self) -> bool:
        """Rebuild the state now unless that was done within ``catch_up_s``; True when it was rebuilt."""
        if self.api is None or self.clock.monotonic() - self._last_resync < self.settings.catch_up_s:
            return False
        await self._resync(self.api)
        return True

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

    async def _args(self, args: Any) -> ExtenderArgs:
        a = read_args(args)
        if a.nodes is not None:
            if not self.fixed_fleet:
                self._learn(a.nodes)
            return a
        now = self.clock.monotonic()
        if (
            self.api is not None
            and not self.fixed_fleet
            and now >= self._next_refresh
            and any(n not in self.state.index for n in a.names)
        ):  # a node joined since the last resync (or a node without cards: asked again only after a while)
            self._next_refresh = now + self.settings.refresh_s
            self._set_nodes(await self._api_nodes())
        return a

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

    def _place(self, request: Request, names: list[str]) -> Placement | None:
        """Decide among the candidates ``names`` and hold the placement until the bind (None: it fits nowhere)."""
        index = self.state.index
        known = [n for n in names if n in index]
        everywhere = len(known) == len(self.state) and len(set(known)) == len(known)
        decision = self._scheduler.decide(request, None if everywhere else [index[n] for n in known])
        if decision.placement is None:
            return None
        self._scheduler.commit(decision.request, decision.placement)
        expires = self.clock.monotonic() + self.settings.assume_ttl_s
        self._assumed[request.name] = _Assumed(decision.request, decision.placement, expires)
        return decision.placement

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
            raise ExtenderError(f"{why_not(decision, pod)} on node {node}")
        self._scheduler.commit(decision.request, decision.placement)
        self._assumed[request.name] = _Assumed(
            decision.request, decision.placement, self.clock.monotonic() + self.settings.assume_ttl_s
        )
        return decision.placement

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


def _healthy(node: Node) -> Node:
    gpus = tuple(dataclasses.replace(g, health=Health.HEALTHY) for g in node.gpus)
    return dataclasses.replace(node, gpus=gpus, health=Health.HEALTHY)
