"""GPU-type constraints of a profile: only some models, never some models, and models to prefer.

(A request's own ``gpu_models`` are enforced by resource fit; this plugin is for policy — e.g. a tier that may
only use A10s, or keeping a scarce model for the work that asks for it by scoring it low for the rest.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True)
class GpuTypePolicy:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    allow: frozenset[str] = frozenset()
    """Models GPU work may use (empty: any)."""
    deny: frozenset[str] = frozenset()
    prefer: frozenset[str] = frozenset()
    """Models scored 100; others 0. Unconstrained requests are steered away from models in ``reserve``."""
    reserve: frozenset[str] = frozenset()
    name: str = "gpu-type"

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        if ctx.request.num_gpu == 0 or not (self.allow or self.deny):
            return list(nodes)
        all_nodes = ctx.state.nodes
        return [
            i
            for i in nodes
            if (not self.allow or all_nodes[i].gpu_model in self.allow) and all_nodes[i].gpu_model not in self.deny
        ]

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        all_nodes = ctx.state.nodes
        steer = not ctx.request.gpu_models
        out: list[float] = []
        for i in nodes:
            model = all_nodes[i].gpu_model
            s = 100.0 if not self.prefer or model in self.prefer else 0.0
            if steer and model in self.reserve:
                s = 0.0
            out.append(s)
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> GpuTypePolicy:
    return GpuTypePolicy(
        frozenset(args.names("allow")),
        frozenset(args.names("deny")),
        frozenset(args.names("prefer")),
        frozenset(args.names("reserve")),
        name,
    )
