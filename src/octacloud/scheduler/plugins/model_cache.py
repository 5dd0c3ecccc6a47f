"""Cache-aware placement: a node that already holds the request's model scores higher (no download before the
replica can load).

A scoring term of the profile like any other: its weight against the packing terms sets how much packing the
product gives up for a warm start (bench/storage.py measures both sides). Nodes that hold the model score
100, others 0; a request without a model, or a profile built without a cache view, scores every node alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext


class CachedModels(Protocol):
    """Which models each node's cache holds. Must be cheap (it is asked once per candidate node and decision)
    and never raise."""

    def holds(self, node: str, model: str) -> bool: ...


@dataclass(slots=True)
class ModelCacheAffinity:
    node_local: ClassVar[bool] = False
    """Not node-local: the answer depends on the node's cache, not on its capacity."""

    view: CachedModels | None = None
    name: str = "model-cache"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        model, view = ctx.request.model, self.view
        if not model or view is None:
            return [0.0] * len(nodes)
        names = ctx.state.nodes
        return [100.0 if view.holds(names[i].name, model) else 0.0 for i in nodes]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> ModelCacheAffinity:
    return ModelCacheAffinity(ctx.model_cache, name)
