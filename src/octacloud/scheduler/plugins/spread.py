"""Spread: prefer the emptiest node (least allocated), the opposite of packing — for fault isolation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True)
class Spread:
    """Score 0..100: free share of the node's GPU capacity (of its CPU, for CPU-only requests)."""

    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "spread"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        state = ctx.state
        sigs, all_nodes = state.signature, state.nodes
        out: list[float] = []
        for i in nodes:
            node = all_nodes[i]
            if ctx.request.num_gpu and node.gpu_count:
                out.append(100.0 * sum(sigs[i].free_gpu) / node.gpu_milli)
            else:
                out.append(100.0 * sigs[i].free_cpu / node.cpu_milli if node.cpu_milli else 0.0)
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> Spread:
    return Spread(name)
