"""A scoring term fed by node telemetry (GPU utilisation, memory bandwidth, network latency, power price ...).

One instance per metric; a profile weighs a dozen of them as configuration. Raw values are min-max normalised
over the candidate nodes so that metrics on different scales weigh as configured. With ``max`` (or ``min``) set,
the plugin is also a filter: nodes above (below) the threshold do not qualify (e.g. network load under 0.8).
A node without the metric scores as the worst candidate and passes a threshold filter only if ``missing`` is
``neutral``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.errors import InvalidSpecError
from octacloud.scheduler.framework.api import CycleContext, min_max_normalize
from octacloud.scheduler.registry import Args, PluginContext
from octacloud.scheduler.telemetry import TelemetrySource


@dataclass(slots=True)
class TelemetryScore:
    node_local: ClassVar[bool] = False
    """Not node-local: its values are per node name, not per node state."""

    source: TelemetrySource
    metric: str
    prefer: str = "low"
    """``low``: smaller values are better (latency, price); ``high``: larger are better."""
    maximum: float | None = None
    minimum: float | None = None
    missing: str = "worst"
    name: str = "telemetry"

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]:
        if self.maximum is None and self.minimum is None:
            return list(nodes)
        snapshot = self.source.snapshot()
        names = ctx.state.nodes
        kept: list[int] = []
        for i in nodes:
            value = snapshot.get(names[i].name, {}).get(self.metric)
            if value is None:
                if self.missing == "neutral":
                    kept.append(i)
                continue
            if (self.maximum is None or value <= self.maximum) and (self.minimum is None or value >= self.minimum):
                kept.append(i)
        return kept

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        snapshot = self.source.snapshot()
        names = ctx.state.nodes
        sign = -1.0 if self.prefer == "low" else 1.0
        values = [snapshot.get(names[i].name, {}).get(self.metric) for i in nodes]
        known = [sign * v for v in values if v is not None]
        worst = min(known, default=0.0)
        return [sign * v if v is not None else worst for v in values]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return min_max_normalize(scores)


def build(name: str, args: Args, ctx: PluginContext) -> TelemetryScore:
    if ctx.telemetry is None:
        raise InvalidSpecError(f"{args.where}: plugin 'telemetry' needs a telemetry source (telemetry=...)")
    maximum = args.number("max", float("nan"))
    minimum = args.number("min", float("nan"))
    return TelemetryScore(
        ctx.telemetry,
        args.text("metric", None),
        args.text("prefer", "low", choices=("low", "high")),
        None if maximum != maximum else maximum,
        None if minimum != minimum else minimum,
        args.text("missing", "worst", choices=("worst", "neutral")),
        name,
    )
