"""The design's memory rule: one model may use at most 80 % of one card's memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.units import MAX_MODEL_MEMORY_PERCENT
from octacloud.scheduler.framework.api import SUCCESS, Code, CycleContext, Status
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True)
class ModelMemoryLimit:
    """Keeps nodes with at least ``num_gpu`` cards whose ``percent`` % of memory holds the request's per-card
    GPU memory; rejects up front a request too big for every card of the fleet."""

    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    percent: int = MAX_MODEL_MEMORY_PERCENT
    name: str = "model-memory"

    def limit(self, card_memory_mib: int) -> int:
        return card_memory_mib * self.percent // 100

    def pre_filter(self, ctx: CycleContext) -> Status:
        need = ctx.request.gpu_memory_mib
        if need == 0 or ctx.request.num_gpu == 0:
            return Status(Code.SKIP)
        biggest = max((g.memory_mib for n in ctx.state.nodes for g in n.gpus), default=0)
        if need > self.limit(biggest):
            return Status(
                Code.UNSCHEDULABLE,
                f"needs {need} MiB per card; a model may use at most {self.percent} % of a card "
                f"({self.limit(biggest)} MiB on the largest card)",
            )
        return SUCCESS

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        r = ctx.request
        all_nodes = ctx.state.nodes
        return [
            i
            for i in nodes
            if sum(1 for g in all_nodes[i].gpus if r.gpu_memory_mib <= self.limit(g.memory_mib)) >= r.num_gpu
        ]


def build(name: str, args: Args, ctx: PluginContext) -> ModelMemoryLimit:
    return ModelMemoryLimit(args.integer("percent", MAX_MODEL_MEMORY_PERCENT, low=1, high=100), name)
