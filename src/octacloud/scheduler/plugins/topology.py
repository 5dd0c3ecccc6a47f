"""NVLink topology: a multi-card request should get cards of one NVLink group.

Score: 100 when the node can give all the request's cards from one NVLink group, 50 when it must span groups
of a node that has NVLink, 0 on PCIe-only nodes (single-card and CPU-only requests: 100 everywhere). Card
selector: the fully free cards of the smallest NVLink group that can hold the request (fewest cards stranded),
lowest indices first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.plugins.fit import cards_that_fit
from octacloud.scheduler.registry import Args, PluginContext


def free_cards_by_group(ctx: CycleContext, node: int) -> dict[int | None, list[int]]:
    gpus = ctx.state.nodes[node].gpus
    free = ctx.state.signature[node].free_gpu
    groups: dict[int | None, list[int]] = defaultdict(list)
    for g in cards_that_fit(ctx.state, ctx.request, node):
        if free[g] == MILLI_PER_GPU:
            groups[gpus[g].nvlink_group].append(g)
    return groups


@dataclass(slots=True)
class NvlinkTopology:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "nvlink-topology"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        n = ctx.request.num_gpu
        if n <= 1:
            return [100.0] * len(nodes)
        out: list[float] = []
        for i in nodes:
            groups = free_cards_by_group(ctx, i)
            if any(k is not None and len(v) >= n for k, v in groups.items()):
                out.append(100.0)
            elif any(g.nvlink_group is not None for g in ctx.state.nodes[i].gpus):
                out.append(50.0)
            else:
                out.append(0.0)
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)

    def select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None:
        n = ctx.request.num_gpu
        if n <= 1:
            return None
        fitting = [v for k, v in free_cards_by_group(ctx, node).items() if k is not None and len(v) >= n]
        if not fitting:
            return None
        return tuple(min(fitting, key=lambda v: (len(v), v[0]))[:n])


def build(name: str, args: Args, ctx: PluginContext) -> NvlinkTopology:
    return NvlinkTopology(name)
