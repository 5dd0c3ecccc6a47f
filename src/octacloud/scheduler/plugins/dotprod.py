"""DotProd (Tetris-style alignment), the published baseline: merged GPU dimension, normalised by the largest spec.

Node vector ``(free CPU / 128 cores, free GPU / 8 cards)``, request vector likewise; score
``int(100 × (1 − node·request / 2))`` — a smaller dot product (less of the node's free capacity aligned with the
request) is better. Not normalised; the authors' card choice for it is best fit (the runner's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.scheduler.framework.api import CycleContext, identity_normalize
from octacloud.scheduler.registry import Args, PluginContext

MAX_SPEC_CPU = 128_000
"""The authors' normalising spec: 128 cores (milli-CPU)."""
MAX_SPEC_GPU = 8_000
"""The authors' normalising spec: 8 cards (milli-GPU)."""


@dataclass(slots=True)
class DotProduct:
    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    name: str = "dotprod"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        r = ctx.request
        pod_cpu = r.cpu_milli / MAX_SPEC_CPU
        pod_gpu = r.total_gpu_milli / MAX_SPEC_GPU
        sigs = ctx.state.signature
        out: list[float] = []
        for i in nodes:
            _model, cpu, _mem, free = sigs[i]
            if cpu < r.cpu_milli:
                out.append(0.0)
                continue
            dot = (cpu / MAX_SPEC_CPU) * pod_cpu + (sum(free) / MAX_SPEC_GPU) * pod_gpu
            out.append(float(int(100 * (1 - dot / 2))))
        return out

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> DotProduct:
    return DotProduct(name)
