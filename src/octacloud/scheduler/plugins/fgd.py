"""FGD: fragmentation gradient descent (Weng et al., ATC'23), as the authors' simulator implements it.

Score: ``int(sigmoid((F_before − F_after) / 1000) × 100)`` where F is the node's fragmentation under the target
workload (``octacloud.scheduler.fragmentation``), not normalised. For a sharing request each card that fits is
tried and the best (first on ties) wins, which is also the card FGD places it on; other requests take the first
fully free cards by index, CPU-only requests change only the node's CPU.

Results are cached per (request shape, node signature): a node is re-scored only after it changed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.fragmentation import FragmentationModel, TargetWorkload, compile_workload
from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.framework.state import ClusterState, NodeSignature
from octacloud.scheduler.plugins.fit import cards_that_fit
from octacloud.scheduler.registry import Args, PluginContext

_Shape = tuple[int, int, int, int, frozenset[str]]
_Result = tuple[float, tuple[int, ...]]
_CACHE_LIMIT = 1 << 17


def fgd_score(f_before: float, f_after: float) -> int:
    """The authors' integer score for a fragmentation change (higher = less fragmentation added)."""
    return int(1.0 / (1.0 + math.exp(-(f_before - f_after) / 1000.0)) * 100)


@dataclass(slots=True)
class FragmentationGradient:
    """Score plugin and card selector: place where the workload's expected fragmentation grows least."""

    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    workload: TargetWorkload
    name: str = "fgd"
    model: FragmentationModel = field(init=False)
    _cache: dict[_Shape, dict[NodeSignature, _Result]] = field(default_factory=dict, init=False)
    _by_node: dict[_Shape, tuple[list[int], list[float]]] = field(default_factory=dict, init=False)
    """Per shape: the node version last scored and its score (skips hashing unchanged nodes' signatures)."""
    _state: ClusterState | None = field(default=None, init=False)
    _size: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.model = compile_workload(self.workload)

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        r = ctx.request
        state = ctx.state
        if state is not self._state or self._size > _CACHE_LIMIT:
            self._state = state
            self._cache.clear()
            self._by_node.clear()
            self._size = 0
        shape = _shape(r)
        # Nodes with equal signatures score alike unless card memory or per-card models matter.
        share_by_signature = not (r.gpu_memory_mib or r.gpu_models)
        cache = self._cache.get(shape)
        if cache is None:
            cache = self._cache[shape] = {}
            self._by_node[shape] = ([-1] * len(state), [0.0] * len(state))
        seen_version, seen_score = self._by_node[shape]
        versions, sigs = state.version, state.signature
        out: list[float] = []
        append = out.append
        for i in nodes:
            v = versions[i]
            if seen_version[i] == v:  # node unchanged since this shape last scored it
                append(seen_score[i])
                continue
            if share_by_signature:
                sig = sigs[i]
                hit = cache.get(sig)
                if hit is None:
                    hit = cache[sig] = self._evaluate(ctx, i)
                    self._size += 1
            else:
                hit = self._evaluate(ctx, i)
                self._size += 1
            seen_version[i] = v
            seen_score[i] = hit[0]
            append(hit[0])
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)  # the authors' FGD has no normalisation step

    def select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None:
        r = ctx.request
        if not r.is_sharing:
            return None  # whole cards: the first fully free ones (the runner's default)
        if not (r.gpu_memory_mib or r.gpu_models):
            cache = self._cache.get(_shape(r))
            hit = cache.get(ctx.state.signature[node]) if cache is not None else None
            if hit is not None:
                return hit[1] or None
        return self._evaluate(ctx, node)[1] or None

    def _evaluate(self, ctx: CycleContext, node: int) -> _Result:
        state, r = ctx.state, ctx.request
        gpu_model, cpu_left, _memory, free = state.signature[node]
        frag = self.model.fragmentation
        before = frag(gpu_model, cpu_left, free)
        cpu_after = cpu_left - r.cpu_milli
        if r.is_sharing:
            best, card = 0, -1
            for g in cards_that_fit(state, r, node):
                after = list(free)
                after[g] -= r.gpu_milli
                s = fgd_score(before, frag(gpu_model, cpu_after, after))
                if card < 0 or s > best:
                    best, card = s, g
            return (float(best), (card,)) if card >= 0 else (0.0, ())
        after = list(free)
        if r.num_gpu:
            whole = [g for g in cards_that_fit(state, r, node) if free[g] == MILLI_PER_GPU][: r.num_gpu]
            for g in whole:
                after[g] = 0
        return float(fgd_score(before, frag(gpu_model, cpu_after, after))), ()


def build(name: str, args: Args, ctx: PluginContext) -> FragmentationGradient:
    if ctx.workload is None:
        raise InvalidSpecError(
            f"{args.where}: plugin 'fgd' needs a target workload (build the profile with workload=...)"
        )
    return FragmentationGradient(ctx.workload, name)


def _shape(r: Request) -> _Shape:
    return (r.cpu_milli, r.gpu_milli, r.num_gpu, r.gpu_memory_mib, r.gpu_models)
