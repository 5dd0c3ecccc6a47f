"""Free share of one node resource as a score (the design brief's sketch: 0.7 × CPU idle + 0.3 × free memory).

``resource`` is ``cpu``, ``memory``, ``gpu`` (milli-GPU) or ``gpu_memory``; the score is the free share of the
node's capacity after placing the request, 0..100 (more free scores higher; with ``prefer: low`` less free
scores higher, which packs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext

RESOURCES = ("cpu", "memory", "gpu", "gpu_memory")


@dataclass(slots=True)
class FreeResource:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    resource: str = "cpu"
    prefer: str = "high"
    name: str = "free-resource"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        state, r = ctx.state, ctx.request
        out: list[float] = []
        for i in nodes:
            node = state.nodes[i]
            if self.resource == "cpu":
                free, cap = state.free_cpu[i] - r.cpu_milli, node.cpu_milli
            elif self.resource == "memory":
                free, cap = state.free_memory[i] - r.memory_mib, node.memory_mib
            elif self.resource == "gpu":
                free, cap = sum(state.signature[i].free_gpu) - r.total_gpu_milli, node.gpu_milli
            else:
                free = sum(state.free_gpu_memory[i]) - r.num_gpu * r.gpu_memory_mib
                cap = sum(g.memory_mib for g in node.gpus)
            share = min(max(free / cap, 0.0), 1.0) if cap else 0.0
            out.append(100.0 * (share if self.prefer == "high" else 1.0 - share))
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> FreeResource:
    return FreeResource(
        args.text("resource", None, choices=RESOURCES), args.text("prefer", "high", choices=("high", "low")), name
    )
