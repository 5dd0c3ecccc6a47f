"""GpuPacking, the published baseline: prefer partly used cards, then partly used nodes, then idle nodes.

Bands (authors' integer arithmetic): using only already-shared cards → 50..100 (fuller cards higher); needing
fully free cards on a used node → 33..50 (fewer such cards higher); an idle node → 0..33 (smaller nodes higher).
CPU-only requests score 0 everywhere. Not normalised; card choice: best fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext


def packing_score(free: tuple[int, ...], milli: int, count: int) -> int:
    fully_free = free.count(MILLI_PER_GPU)
    if fully_free == len(free):
        return max(100 // 3 - fully_free, fully_free)
    need = count
    whole_used = 0
    used_free = 0
    for g in sorted(range(len(free)), key=free.__getitem__):  # stable: least free first
        if need == 0:
            break
        if milli <= free[g]:
            need -= 1
            used_free += free[g] * 100 // MILLI_PER_GPU
            if free[g] == MILLI_PER_GPU:
                whole_used += 1
    if need:
        return 0
    if whole_used:
        return max(100 // 2 - whole_used, 100 // 3)
    return max(100 - used_free // 10, 100 // 2)


@dataclass(slots=True)
class GpuPacking:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "gpu-packing"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        r = ctx.request
        if r.num_gpu == 0:
            return [0.0] * len(nodes)
        sigs = ctx.state.signature
        return [float(packing_score(sigs[i].free_gpu, r.gpu_milli, r.num_gpu)) for i in nodes]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> GpuPacking:
    return GpuPacking(name)
