"""Declared topologies, state snapshots and the invariants every scheduler action must keep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from octacloud.core import MILLI_PER_GPU, Gpu, Node, Placement, Request
from octacloud.scheduler.framework import ClusterState

CARD_MIB = 16 * 1024


def node(
    name: str,
    cards: int = 2,
    *,
    cpu: int = 64_000,
    memory: int = 262_144,
    model: str = "T4",
    card_mib: int = CARD_MIB,
    nvlink: Sequence[int | None] | None = None,
) -> Node:
    groups = list(nvlink) if nvlink is not None else [None] * cards
    return Node(name, cpu, memory, tuple(Gpu(g, model, card_mib, groups[g]) for g in range(cards)))


def req(
    name: str,
    milli: int = 0,
    cards: int = 1,
    *,
    cpu: int = 1000,
    memory: int = 1024,
    gpu_mib: int = 0,
    models: Sequence[str] = (),
    priority: int = 0,
    pinned: bool = False,
    failover: bool = False,
) -> Request:
    return Request(
        name,
        num_gpu=cards if milli else 0,
        gpu_milli=milli,
        gpu_memory_mib=gpu_mib,
        cpu_milli=cpu,
        memory_mib=memory,
        gpu_models=frozenset(models),
        priority=priority,
        pinned=pinned,
        failover=failover,
    )


def place(state: ClusterState, request: Request, node_name: str, cards: Sequence[int] = ()) -> None:
    """Pre-allocate ``request`` on given cards (building a declared starting state)."""
    state.allocate(request, Placement(request.name, node_name, tuple(cards), request.gpu_milli if cards else 0))


def snapshot(state: ClusterState) -> object:
    """Everything observable about the accounting (allocation order and node versions excluded)."""
    return (
        [list(x) for x in state.free_gpu],
        [list(x) for x in state.free_gpu_memory],
        list(state.free_cpu),
        list(state.free_memory),
        list(state.signature),
        state.allocated_gpu_milli,
        {k: (a.request, a.placement, a.node_index) for k, a in state.allocations.items()},
        [sorted(on) for on in state.on_node],
    )


def check_invariants(state: ClusterState, *, headroom_percent: int | None = None, high_priority: int = 100) -> None:
    """Raise AssertionError if any accounting invariant or product rule is broken."""
    used_milli: list[list[int]] = [[0] * n.gpu_count for n in state.nodes]
    used_mem: list[list[int]] = [[0] * n.gpu_count for n in state.nodes]
    used_cpu = [0] * len(state)
    used_memory = [0] * len(state)
    normal = 0
    for name, a in state.allocations.items():
        r, p, i = a.request, a.placement, a.node_index
        assert name == r.name == p.request, name
        assert state.nodes[i].name == p.node
        assert name in state.on_node[i]
        assert len(p.gpus) == r.num_gpu == len(set(p.gpus)), f"{name}: cards {p.gpus} for {r.num_gpu}"
        if r.num_gpu > 1:
            assert p.milli_per_gpu == MILLI_PER_GPU, f"{name}: multi-card must take whole cards"
        for g in p.gpus:
            used_milli[i][g] += p.milli_per_gpu
            used_mem[i][g] += r.gpu_memory_mib
            assert r.gpu_memory_mib <= state.nodes[i].gpus[g].memory_mib
        used_cpu[i] += r.cpu_milli
        used_memory[i] += r.memory_mib
        if not (r.failover or r.priority >= high_priority):
            normal += r.total_gpu_milli
    for i, n in enumerate(state.nodes):
        assert state.free_cpu[i] == n.cpu_milli - used_cpu[i] >= 0, n.name
        assert state.free_memory[i] == n.memory_mib - used_memory[i] >= 0, n.name
        for g, gpu in enumerate(n.gpus):
            assert 0 <= used_milli[i][g] <= MILLI_PER_GPU, f"{n.name} card {g}: {used_milli[i][g]} milli"
            assert state.free_gpu[i][g] == MILLI_PER_GPU - used_milli[i][g]
            assert 0 <= used_mem[i][g] <= gpu.memory_mib
            assert state.free_gpu_memory[i][g] == gpu.memory_mib - used_mem[i][g]
    assert state.allocated_gpu_milli == sum(a.request.total_gpu_milli for a in state.allocations.values())
    if headroom_percent is not None:
        assert normal <= state.total_gpu_milli * (100 - headroom_percent) // 100, "failover headroom taken"


def check_model_memory_rule(state: ClusterState, percent: int = 80) -> None:
    for a in state.allocations.values():
        for g in a.placement.gpus:
            card = state.nodes[a.node_index].gpus[g]
            assert a.request.gpu_memory_mib <= card.memory_mib * percent // 100


def require_traces() -> Path:
    from ..traces import require_traces as require

    return require()
