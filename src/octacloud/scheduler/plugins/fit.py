"""Resource fit: CPU, memory, card milli-GPU, card memory, GPU model, node and card health."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.api import CycleContext
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.registry import Args, PluginContext


def cards_that_fit(state: ClusterState, request: Request, node: int) -> list[int]:
    """Usable cards of ``node`` that can take one card's worth of ``request`` now (model, milli, memory)."""
    gpus = state.nodes[node].gpus
    free = state.signature[node].free_gpu  # 0 on failed cards and nodes
    free_mem = state.free_gpu_memory[node]
    need = MILLI_PER_GPU if request.num_gpu > 1 else request.gpu_milli
    return [
        g
        for g in range(len(gpus))
        if free[g] >= need and free_mem[g] >= request.gpu_memory_mib and request.allows_model(gpus[g].model)
    ]


def node_fits(state: ClusterState, request: Request, node: int) -> bool:
    """True when ``request`` fits on ``node`` now (whole free cards for whole-card requests)."""
    if not state.usable(node):
        return False
    _model, cpu, memory, free = state.signature[node]
    if request.cpu_milli > cpu or request.memory_mib > memory:
        return False
    if request.num_gpu == 0:
        return True
    cards = cards_that_fit(state, request, node)
    if request.gpu_milli < MILLI_PER_GPU:
        return bool(cards)
    return sum(1 for g in cards if free[g] == MILLI_PER_GPU) >= request.num_gpu


@dataclass(slots=True)
class ResourceFit:
    """Keeps nodes where the request fits now. The fast path reads only the node signature; card memory,
    mixed-model nodes and GPU-model constraints take the exact per-card path."""

    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "resource-fit"

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        r = ctx.request
        state = ctx.state
        cpu, mem, n, milli = r.cpu_milli, r.memory_mib, r.num_gpu, r.gpu_milli
        sigs = state.signature
        usable = state.node_usable
        if n == 0:
            return [i for i in nodes if usable[i] and (s := sigs[i]).free_cpu >= cpu and s.free_memory >= mem]
        if r.gpu_memory_mib or r.gpu_models:
            return [i for i in nodes if node_fits(state, r, i)]
        if milli < MILLI_PER_GPU:
            return [
                i
                for i in nodes
                if sigs[i].free_cpu >= cpu and sigs[i].free_memory >= mem and max(sigs[i].free_gpu, default=0) >= milli
            ]
        return [
            i
            for i in nodes
            if sigs[i].free_cpu >= cpu and sigs[i].free_memory >= mem and sigs[i].free_gpu.count(MILLI_PER_GPU) >= n
        ]


def build(name: str, args: Args, ctx: PluginContext) -> ResourceFit:
    return ResourceFit(name)
