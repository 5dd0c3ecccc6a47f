"""BestFit, the published baseline: the node left with the least free CPU and GPU after placement.

Raw score ``int(100 × (1 − ½·(free CPU − CPU)/128 cores − ½·(free GPU − GPU)/8 cards))``, then the authors'
integer min-max normalisation (``(s − min) × 100 // (max − min)``; all equal → 0), which merges close scores
into ties exactly as their simulator does. Card choice: best fit (the runner's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.scheduler.framework.api import CycleContext
from octacloud.scheduler.plugins.dotprod import MAX_SPEC_CPU, MAX_SPEC_GPU
from octacloud.scheduler.registry import Args, PluginContext


def integer_min_max(scores: list[float]) -> list[float]:
    """The authors' ``NormalizeScore``: integer min-max onto 0..100, all-equal → all 0."""
    if not scores:
        return scores
    low, high = int(min(scores)), int(max(scores))
    if high == low:
        return [0.0] * len(scores)
    span = high - low
    return [float((int(s) - low) * 100 // span) for s in scores]


@dataclass(slots=True)
class BestFit:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "bestfit"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        r = ctx.request
        cpu_req, gpu_req = r.cpu_milli, r.total_gpu_milli
        sigs = ctx.state.signature
        out: list[float] = []
        for i in nodes:
            _model, cpu, _mem, free = sigs[i]
            left = (cpu - cpu_req) / MAX_SPEC_CPU * 0.5 + (sum(free) - gpu_req) / MAX_SPEC_GPU * 0.5
            out.append(float(int((1.0 - left) * 100)))
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return integer_min_max(scores)


def build(name: str, args: Args, ctx: PluginContext) -> BestFit:
    return BestFit(name)
