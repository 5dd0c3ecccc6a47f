"""Replicas apart: the replicas of one deployment (``Request.group``) on different nodes, then different racks.

Each request says how far apart its group must be (``Request.spread``, from the deployment's ``spread``):

* ``soft`` (the default): of the nodes that fit, those holding the fewest of the group's replicas, and of these
  the ones whose rack holds the fewest; a replica shares a node with its group only where no other node fits (so
  a deployment of two or more replicas is never all on one node while another node fits);
* ``node`` (hard): at most one replica of the group per node (then the fewest on the rack, as ``soft``);
* ``rack`` (hard): at most one per rack (a node that declares no rack is a rack of its own).

Among the nodes it keeps, the profile's scorers choose as for any request (packing, fragmentation): the spread
comes first, placement quality second.

A request without a group is none of this plugin's business (its pre-filter skips it, so the runner's indexed
path stays open to the simulator's trace pods). Put the plugin after every other filter of a profile: ``soft``
keeps the best of what the filters before it left. Where each group's replicas are is
kept per node from the state's changes (``ClusterState.watch``), so a decision costs the group's nodes, not a
walk over every allocation. Pure policy over a :class:`ClusterState`; the live cloud and the simulator run the
same code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from octacloud.core.domains import domain_of
from octacloud.scheduler.framework.api import SUCCESS, Code, CycleContext, Status
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True, weakref_slot=True)
class GroupIndex:
    """Where each group's replicas are: group → node index → replicas there (kept from the state's changes)."""

    state: ClusterState
    rack: list[str] = field(init=False)
    nodes_of: dict[str, Counter[int]] = field(init=False, default_factory=dict)
    _per_node: list[Counter[str]] = field(init=False)
    _dirty: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.rack = [domain_of(n, "rack") for n in self.state.nodes]
        self._per_node = [Counter() for _ in self.state.nodes]
        self._dirty = set(range(len(self.state.nodes)))
        self.state.watch(self._changed)

    def _changed(self, i: int) -> None:
        self._dirty.add(i)

    def group(self, name: str) -> Counter[int]:
        """Node index → replicas of group ``name`` there (current)."""
        for i in self._dirty:
            old, new = self._per_node[i], Counter(a.request.group for a in self.state.on_node[i].values())
            new.pop("", None)
            for g in old.keys() | new.keys():
                if old[g] == new[g]:
                    continue
                where = self.nodes_of.setdefault(g, Counter())
                if new[g]:
                    where[i] = new[g]
                else:
                    where.pop(i, None)
                    if not where:
                        del self.nodes_of[g]
            self._per_node[i] = new
        self._dirty.clear()
        return self.nodes_of.get(name, Counter())


@dataclass(slots=True)
class ReplicaSpread:
    name: str = "replica-spread"
    _index: GroupIndex | None = field(default=None, init=False, repr=False)

    def index(self, state: ClusterState) -> GroupIndex:
        if self._index is None or self._index.state is not state:
            self._index = GroupIndex(state)
        return self._index

    def _siblings(self, ctx: CycleContext) -> tuple[Counter[int], Counter[str]]:
        """The request's group per node and per rack, without the request itself (it may be re-placed)."""
        found = ctx.scratch.get(self.name)
        if found is None:
            index = self.index(ctx.state)
            on_node = Counter(index.group(ctx.request.group))
            own = ctx.state.allocations.get(ctx.request.name)
            if own is not None and own.request.group == ctx.request.group:
                on_node[own.node_index] -= 1
            on_node = +on_node
            on_rack: Counter[str] = Counter()
            for i, n in on_node.items():
                on_rack[index.rack[i]] += n
            found = ctx.scratch[self.name] = (on_node, on_rack)
        return found  # type: ignore[return-value]

    def pre_filter(self, ctx: CycleContext) -> Status:
        return SUCCESS if ctx.request.group else Status(Code.SKIP)

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        on_node, on_rack = self._siblings(ctx)
        if not on_node:
            return list(nodes)
        rack = self.index(ctx.state).rack
        mode = ctx.request.spread
        if mode == "node":
            nodes = [i for i in nodes if i not in on_node]
        elif mode == "rack":
            nodes = [i for i in nodes if rack[i] not in on_rack]
        if not nodes:
            return []
        best = min((on_node[i], on_rack[rack[i]]) for i in nodes)
        return [i for i in nodes if (on_node[i], on_rack[rack[i]]) == best]


def build(name: str, args: Args, ctx: PluginContext) -> ReplicaSpread:
    return ReplicaSpread(name)
