"""Failover headroom: normal-priority work may not take the last ``percent`` % of fleet GPU capacity.

The reserve exists so that work lost to a failed card or node can be re-placed at once (the design warns that
running hot makes failures cascade). Requests marked ``failover`` and requests with priority at least
``high_priority`` may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from octacloud.core.units import DEFAULT_HEADROOM_PERCENT
from octacloud.scheduler.framework.api import SUCCESS, Code, CycleContext, Status
from octacloud.scheduler.registry import Args, PluginContext

DEFAULT_HIGH_PRIORITY = 100


@dataclass(slots=True)
class FailoverHeadroom:
    percent: int = DEFAULT_HEADROOM_PERCENT
    high_priority: int = DEFAULT_HIGH_PRIORITY
    name: str = "failover-headroom"

    def may_use_reserve(self, ctx: CycleContext) -> bool:
        return ctx.request.failover or ctx.request.priority >= self.high_priority

    def ceiling(self, total_gpu_milli: int) -> int:
        """Milli-GPU that normal work may hold in all."""
        return total_gpu_milli * (100 - self.percent) // 100

    def pre_filter(self, ctx: CycleContext) -> Status:
        r = ctx.request
        if r.num_gpu == 0 or self.may_use_reserve(ctx):
            return Status(Code.SKIP)
        state = ctx.state
        ceiling = self.ceiling(state.total_gpu_milli)
        if state.allocated_gpu_milli + r.total_gpu_milli > ceiling:
            return Status(
                Code.UNSCHEDULABLE,
                f"would use the failover reserve: {state.allocated_gpu_milli} + {r.total_gpu_milli} milli-GPU "
                f"> {ceiling} ({100 - self.percent} % of the fleet); only failover or priority >= "
                f"{self.high_priority} work may",
            )
        return SUCCESS


def build(name: str, args: Args, ctx: PluginContext) -> FailoverHeadroom:
    return FailoverHeadroom(
        args.integer("percent", DEFAULT_HEADROOM_PERCENT, low=0, high=100),
        args.integer("high_priority", DEFAULT_HIGH_PRIORITY),
        name,
    )
