"""Mutable accounting of what is free on every node and card: the scheduler's view of the fleet.

All quantities are integers (milli-GPU, milli-CPU, MiB). Every change goes through :meth:`ClusterState.
allocate` or :meth:`ClusterState.release`, which validate against capacity and keep the invariants:

* no card above 1000 milli-GPU or its memory; no node above its CPU or memory;
* a multi-card allocation takes whole cards on one node;
* ``allocated_gpu_milli`` equals the sum over cards of what is taken.

Each node carries a ``version`` that changes whenever the node changes, and a ``signature`` (what is free on
it, as a hashable tuple) so that plugins can cache per-node results: two nodes with the same signature and
GPU model score the same for the same request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Health, Node, Placement, Request
from octacloud.core.units import MILLI_PER_GPU


class NodeSignature(NamedTuple):
    """What is free on a node, hashable: equal signatures (and GPU model) score the same for the same request."""

    gpu_model: str
    free_cpu: int
    """Free CPU milli (0 on a node that is not healthy)."""
    free_memory: int
    """Free memory MiB (0 on a node that is not healthy)."""
    free_gpu: tuple[int, ...]
    """Free milli-GPU per card in index order; 0 on failed cards and nodes."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """A request that holds resources, and where."""

    request: Request
    placement: Placement
    node_index: int


class ClusterState:
    """Free and used capacity of a fixed set of nodes.

    Nodes are addressed by their index in :attr:`nodes` (fast) or by name. Failed cards and nodes keep their
    allocations (so that failover can see what was lost) but offer no free capacity.
    """

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.index: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.name in self.index:
                raise InvalidSpecError(f"duplicate node name {node.name!r}")
            self.index[node.name] = i
        self.free_cpu: list[int] = [n.cpu_milli for n in self.nodes]
        self.free_memory: list[int] = [n.memory_mib for n in self.nodes]
        self.free_gpu: list[list[int]] = [[MILLI_PER_GPU] * n.gpu_count for n in self.nodes]
        self.free_gpu_memory: list[list[int]] = [[g.memory_mib for g in n.gpus] for n in self.nodes]
        self.version: list[int] = [0] * len(self.nodes)
        self.signature: list[NodeSignature] = [self._signature(i) for i in range(len(self.nodes))]
        self.allocations: dict[str, Allocation] = {}
        self.on_node: list[dict[str, Allocation]] = [{} for _ in self.nodes]
        self.total_gpu_milli: int = sum(n.gpu_milli for n in self.nodes)
        self.allocated_gpu_milli: int = 0
        self._usable: list[bool] = [n.health is Health.HEALTHY for n in self.nodes]
        self.node_usable: Sequence[bool] = self._usable
        """Read-only view: ``node_usable[i]`` is :meth:`usable` ``(i)`` (for hot loops)."""
        self._watchers: list[weakref.WeakMethod[Callable[[int], None]]] = []
        self._free_by_model: dict[str, int] = {}
        for sig in self.signature:
            if sig.free_gpu:
                self._free_by_model[sig.gpu_model] = self._free_by_model.get(sig.gpu_model, 0) + sum(sig.free_gpu)

    # ---- queries ---------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.nodes)

    def node_index(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise NotFoundError(f"no node named {name!r}") from None

    def usable(self, i: int) -> bool:
        """True when node ``i`` may receive new work (healthy)."""
        return self._usable[i]

    def card_usable(self, i: int, gpu: int) -> bool:
        return self._usable[i] and self.nodes[i].gpus[gpu].health is Health.HEALTHY

    def free_gpu_milli(self, i: int) -> int:
        """Free milli-GPU on node ``i``'s usable cards."""
        return sum(self.signature[i].free_gpu)

    def utilisation(self) -> float:
        """Allocated share of all GPU capacity, 0..1."""
        return self.allocated_gpu_milli / self.total_gpu_milli if self.total_gpu_milli else 0.0

    def __iter__(self) -> Iterator[Allocation]:
        return iter(self.allocations.values())

    def free_gpu_milli_by_model(self) -> Mapping[str, int]:
        """Free milli-GPU on usable cards per GPU model (a node's cards count under its ``gpu_model``), kept as
        the state changes: reading it costs nothing, unlike a walk over every node's signature. Every model of a
        node with cards is a key, with 0 when nothing is free on it. Read-only: the state owns it."""
        return self._free_by_model

    # ---- changes ---------------------------------------------------------------------------------------

    def watch(self, callback: Callable[[int], None]) -> None:
        """Call the bound method ``callback(i)`` after every change of node ``i`` (held weakly: a watcher that is
        no longer referenced elsewhere stops being called). Indexes over the nodes keep themselves current so."""
        self._watchers.append(weakref.WeakMethod(callback))

    def check_fits(self, request: Request, placement: Placement) -> None:
        """Raise :class:`InvalidSpecError` naming the first resource that ``placement`` would overrun."""
        i = self.node_index(placement.node)
        node = self.nodes[i]
        where = f"request {request.name!r} on node {node.name!r}"
        if request.name in self.allocations:
            raise InvalidSpecError(f"request {request.name!r} is already allocated")
        if not self._usable[i]:
            raise InvalidSpecError(f"{where}: the node is {node.health.value}")
        if len(placement.gpus) != request.num_gpu or len(set(placement.gpus)) != len(placement.gpus):
            raise InvalidSpecError(f"{where}: needs {request.num_gpu} distinct cards, got {placement.gpus}")
        if request.num_gpu and placement.milli_per_gpu != request.gpu_milli:
            raise InvalidSpecError(
                f"{where}: placement takes {placement.milli_per_gpu} milli per card, request asks {request.gpu_milli}"
            )
        if request.cpu_milli > self.free_cpu[i]:
            raise InvalidSpecError(f"{where}: needs {request.cpu_milli} CPU milli, {self.free_cpu[i]} free")
        if request.memory_mib > self.free_memory[i]:
            raise InvalidSpecError(f"{where}: needs {request.memory_mib} MiB memory, {self.free_memory[i]} free")
        for g in placement.gpus:
            if not 0 <= g < node.gpu_count:
                raise InvalidSpecError(f"{where}: node has no card {g}")
            if not self.card_usable(i, g):
                raise InvalidSpecError(f"{where}: card {g} is {node.gpus[g].health.value}")
            if not request.allows_model(node.gpus[g].model):
                raise InvalidSpecError(
                    f"{where}: card {g} is a {node.gpus[g].model}, allowed {sorted(request.gpu_models)}"
                )
            if request.gpu_milli > self.free_gpu[i][g]:
                raise InvalidSpecError(
                    f"{where}: card {g} has {self.free_gpu[i][g]} milli free, needs {request.gpu_milli}"
                )
            if request.gpu_memory_mib > self.free_gpu_memory[i][g]:
                raise InvalidSpecError(
                    f"{where}: card {g} has {self.free_gpu_memory[i][g]} MiB free, needs {request.gpu_memory_mib}"
                )

    def allocate(self, request: Request, placement: Placement) -> Allocation:
        """Take the resources of ``placement`` for ``request``; raises without changing anything if they don't fit."""
        self.check_fits(request, placement)
        i = self.index[placement.node]
        self.free_cpu[i] -= request.cpu_milli
        self.free_memory[i] -= request.memory_mib
        for g in placement.gpus:
            self.free_gpu[i][g] -= request.gpu_milli
            self.free_gpu_memory[i][g] -= request.gpu_memory_mib
        self.allocated_gpu_milli += request.total_gpu_milli
        allocation = Allocation(request, placement, i)
        self.allocations[request.name] = allocation
        self.on_node[i][request.name] = allocation
        self._changed(i)
        return allocation

    def release(self, name: str) -> Allocation:
        """Give back everything request ``name`` holds and return what it held."""
        try:
            allocation = self.allocations.pop(name)
        except KeyError:
            raise NotFoundError(f"no allocation for request {name!r}") from None
        request, placement, i = allocation.request, allocation.placement, allocation.node_index
        del self.on_node[i][name]
        self.free_cpu[i] += request.cpu_milli
        self.free_memory[i] += request.memory_mib
        for g in placement.gpus:
            self.free_gpu[i][g] += request.gpu_milli
            self.free_gpu_memory[i][g] += request.gpu_memory_mib
        self.allocated_gpu_milli -= request.total_gpu_milli
        self._changed(i)
        return allocation

    def set_node_health(self, name: str, health: Health) -> None:
        """Mark a node (and so all its cards) healthy, degraded or failed."""
        i = self.node_index(name)
        node = self.nodes[i]
        self.nodes = (*self.nodes[:i], _replace_node(node, health=health), *self.nodes[i + 1 :])
        self._usable[i] = health is Health.HEALTHY
        self._changed(i)

    def set_card_health(self, name: str, gpu: int, health: Health) -> None:
        i = self.node_index(name)
        node = self.nodes[i]
        if not 0 <= gpu < node.gpu_count:
            raise NotFoundError(f"node {name!r} has no card {gpu}")
        gpus = list(node.gpus)
        old = gpus[gpu]
        gpus[gpu] = type(old)(old.index, old.model, old.memory_mib, old.nvlink_group, health)
        self.nodes = (*self.nodes[:i], _replace_node(node, gpus=tuple(gpus)), *self.nodes[i + 1 :])
        self._changed(i)

    def _changed(self, i: int) -> None:
        self.version[i] += 1
        old = self.signature[i]
        new = self.signature[i] = self._signature(i)
        if old.free_gpu:
            self._free_by_model[old.gpu_model] -= sum(old.free_gpu)
        if new.free_gpu:
            self._free_by_model[new.gpu_model] = self._free_by_model.get(new.gpu_model, 0) + sum(new.free_gpu)
        if self._watchers:
            self._notify(i)

    def _notify(self, i: int) -> None:
        dead = False
        for ref in self._watchers:
            callback = ref()
            if callback is None:
                dead = True
            else:
                callback(i)
        if dead:
            self._watchers = [ref for ref in self._watchers if ref() is not None]

    def _signature(self, i: int) -> NodeSignature:
        node = self.nodes[i]
        if node.health is not Health.HEALTHY:
            return NodeSignature(node.gpu_model, 0, 0, (0,) * node.gpu_count)
        # A failed card offers nothing: it counts as full, so card indices stay aligned with the tuple.
        free = tuple(f if node.gpus[g].health is Health.HEALTHY else 0 for g, f in enumerate(self.free_gpu[i]))
        return NodeSignature(node.gpu_model, self.free_cpu[i], self.free_memory[i], free)


def _replace_node(node: Node, **changes: object) -> Node:
    fields = {
        "name": node.name,
        "cpu_milli": node.cpu_milli,
        "memory_mib": node.memory_mib,
        "gpus": node.gpus,
        "labels": node.labels,
        "health": node.health,
    }
    fields.update(changes)
    return Node(**fields)  # type: ignore[arg-type]
