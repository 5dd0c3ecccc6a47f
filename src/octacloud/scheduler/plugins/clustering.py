"""GpuClustering, the published baseline: keep requests of one kind together.

A request's kind is CPU-only, ``share-gpu`` or ``N-gpu``. Score bands: node holding only this kind (75..100),
this kind among others (50..75), an idle node (25..50), other kinds only (0..25); within a band, fuller nodes
(less free GPU out of 8 cards) score higher, in the authors' integer arithmetic. CPU-only requests score 0
everywhere. Not normalised; card choice: best fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.plugins.dotprod import MAX_SPEC_GPU
from octacloud.scheduler.registry import Args, PluginContext


def kind_of(request: Request) -> str:
    if request.num_gpu == 0:
        return ""
    if request.gpu_milli < MILLI_PER_GPU:
        return "share-gpu"
    return f"{request.num_gpu}-gpu"


@dataclass(slots=True)
class GpuClustering:
    node_local: ClassVar[bool] = False
    """Not node-local: its score depends on the kinds of requests already on the node (not in a node class)."""

    name: str = "gpu-clustering"
    _kinds: dict[int, tuple[int, frozenset[str]]] = field(default_factory=dict)

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        kind = kind_of(ctx.request)
        if not kind:
            return [0.0] * len(nodes)
        state = ctx.state
        sigs, versions = state.signature, state.version
        out: list[float] = []
        for i in nodes:
            cached = self._kinds.get(i)
            if cached is None or cached[0] != versions[i]:
                cached = self._kinds[i] = (versions[i], self._node_kinds(ctx, i))
            kinds = cached[1]
            fill = int(25 * (MAX_SPEC_GPU - sum(sigs[i].free_gpu)) / MAX_SPEC_GPU)  # Go truncates toward zero
            if kind in kinds:
                out.append(float(fill + (75 if len(kinds) == 1 else 50)))
            else:
                out.append(float(fill + (25 if not kinds else 0)))
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)

    @staticmethod
    def _node_kinds(ctx: CycleContext, node: int) -> frozenset[str]:
        return frozenset(k for a in ctx.state.on_node[node].values() if (k := kind_of(a.request)))


def build(name: str, args: Args, ctx: PluginContext) -> GpuClustering:
    return GpuClustering(name)
