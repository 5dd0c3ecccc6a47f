"""Autoscaling: a deployment with a target load (``target_qps``) and room between ``min_replicas`` and
``max_replicas`` has its desired count set by the :class:`~octacloud.control.sizing.Autoscaler` from what the
gateway measured since the last pass (requests per second, requests in flight, mean latency)."""

from __future__ import annotations

import math

from octacloud.control.controller.contracts import FootprintSource
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, ReplicaState
from octacloud.control.sizing import Autoscaler, LoadSample, ModelFootprint
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.units import OCTANTS_PER_GPU
from octacloud.gateway.routing import RouteTable


class Autoscaling:
    def __init__(
        self,
        *,
        store: ControllerStore,
        routes: RouteTable,
        footprint: FootprintSource,
        autoscaler: Autoscaler,
        events: EventLog,
        clock: Clock,
    ) -> None:
        self.store, self.routes, self.footprint = store, routes, footprint
        self.autoscaler, self.events, self.clock = autoscaler, events, clock
        self._load: dict[str, tuple[float, int, int]] = {}
        """Deployment → (when, requests, total latency µs) at the previous pass."""

    def autoscale(self, deployments: dict[str, Deployment]) -> None:
        now = self.clock.monotonic()
        for name, d in deployments.items():
            if d.spec.min_replicas == d.spec.max_replicas:
                continue
            try:
                footprint: ModelFootprint | None = self.footprint(d.spec.model)
            except (NotFoundError, InvalidSpecError):
                footprint = None
            generative = footprint is not None and footprint.generative
            if d.spec.target_qps is None and not generative:
                continue
            sample = self._sample(name, now, generative)
            if sample is None:
                continue
            ready = [r for r in self.store.replicas(name) if r.state is ReplicaState.READY and not r.replaces]
            wanted = self.autoscaler.desired(
                name,
                now,
                len(ready) or d.replicas,
                sample,
                capacity_qps=self._capacity(d, footprint),
                slo_ms=d.spec.slo_ms,
                min_replicas=d.spec.min_replicas,
                max_replicas=d.spec.max_replicas,
            )
            if wanted != d.replicas and not math.isnan(sample.qps):
                at = f"{sample.qps:.0f} sequence(s) in flight" if generative else f"{sample.qps:.1f} req/s"
                self.events.record("autoscale", name, f"{d.replicas} → {wanted} at {at}", name)
                d.replicas = wanted
                self.store.put_deployment(d)

    def _sample(self, name: str, now: float, generative: bool) -> LoadSample | None:
        """The load since the previous pass (None at the first one). A generative model's is the engine's
        pressure: sequences in flight over its slots, and time to first token."""
        c = self.routes.counter(name)
        last = self._load.get(name)
        if generative:
            self._load[name] = (now, c.first_tokens, c.first_token_us_total)
        else:
            self._load[name] = (now, c.requests, c.latency_us_total)
        if last is None or now <= last[0]:
            return None
        n = self._load[name][1] - last[1]
        mean_ms = (self._load[name][2] - last[2]) / 1000 / n if n else 0.0
        if generative:
            return LoadSample(qps=float(c.outstanding), outstanding=float(c.outstanding), mean_latency_ms=mean_ms)
        return LoadSample(qps=n / (now - last[0]), outstanding=float(c.outstanding), mean_latency_ms=mean_ms)

    @staticmethod
    def _capacity(d: Deployment, footprint: ModelFootprint | None) -> float:
        """What one replica of ``d`` serves: a generative model's engine slots; else requests per second, from
        the model's profile, or the target's share."""
        if footprint is not None and footprint.generative:
            return float(footprint.max_batch)
        per_card = footprint.samples_per_second_per_card if footprint is not None else None
        if per_card:
            return per_card * d.octants / OCTANTS_PER_GPU
        return (d.spec.target_qps or 0.0) / max(1, d.spec.min_replicas)
