"""The product's minimum unit: a GPU share is rounded up to whole octants (125 milli-GPU).

Profiles that reproduce published results leave this plugin out (raw-milli mode), so trace shares like 470
stay 470; with it, 470 becomes 500.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from octacloud.core.model import Request
from octacloud.core.units import round_up_to_octant
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True)
class OctantUnit:
    """Request rewriter: ``gpu_milli`` → the next multiple of 125 (whole cards are unchanged)."""

    name: str = "octant-unit"

    def rewrite(self, state: ClusterState, request: Request) -> Request:
        rounded = round_up_to_octant(request.gpu_milli)
        return request if rounded == request.gpu_milli else replace(request, gpu_milli=rounded)


def build(name: str, args: Args, ctx: PluginContext) -> OctantUnit:
    return OctantUnit(name)
