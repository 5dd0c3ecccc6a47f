"""Policy: turn a model's profile and a target load into octants per replica and a replica count, and
decide scaling from measured load. Pure functions; no I/O, no clock reads (time is passed in).

Sizing (``--octants auto``):

* memory: a replica needs the model's weights plus ``bytes_per_sample × max_batch`` of activations; the slice's
  share of the card's memory must hold that, and no model may use more than 80 % of a card's memory;
* throughput: the profile gives samples/s on a whole card (or the CPU-card equivalent); a replica on ``k``
  octants serves ``k/8`` of it (MPS splits SMs proportionally; on the CPU the thread budget does);
* the result is the smallest octant count that holds the model, grown (up to one card) while more replicas
  would be needed than ``max_replicas`` allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from octacloud.core.errors import InvalidSpecError
from octacloud.core.units import OCTANTS_PER_GPU, max_model_memory_mib

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What sizing needs to know about a model (from the toolchain's profile or measured at load)."""

    weights_bytes: int
    bytes_per_sample: int = 0
    max_batch: int = 1
    samples_per_second_per_card: float | None = None

    @property
    def memory_mib(self) -> int:
        return math.ceil((self.weights_bytes + self.bytes_per_sample * max(1, self.max_batch)) / MIB)


@dataclass(frozen=True, slots=True)
class Sizing:
    octants: int
    replicas: int
    memory_mib: int


def size_deployment(
    footprint: ModelFootprint,
    card_memory_mib: int,
    *,
    target_qps: float | None,
    min_replicas: int,
    max_replicas: int,
) -> Sizing:
    """Octants per replica and replica count for a model on cards of ``card_memory_mib``."""
    need = footprint.memory_mib
    limit = max_model_memory_mib(card_memory_mib)
    if need > limit:
        raise InvalidSpecError(
            f"the model needs {need} MiB but a model may use at most 80 % of a card's memory ({limit} of "
            f"{card_memory_mib} MiB); use a smaller batch, a quantized variant, or bigger cards"
        )
    octants = max(1, math.ceil(need * OCTANTS_PER_GPU / card_memory_mib))
    per_card = footprint.samples_per_second_per_card
    if target_qps is None or not per_card:
        return Sizing(octants, max(1, min_replicas), need)
    while True:
        capacity = per_card * octants / OCTANTS_PER_GPU
        replicas = max(min_replicas, 1, math.ceil(target_qps / capacity))
        if replicas <= max_replicas or octants == OCTANTS_PER_GPU:
            return Sizing(octants, min(replicas, max_replicas), need)
        octants += 1


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Load measured over the last window for one deployment."""

    qps: float
    outstanding: float
    """Mean requests in flight (queue depth seen at the gateway)."""
    mean_latency_ms: float


@dataclass(slots=True)
class Autoscaler:
    """Replica count from measured load, with hysteresis.

    Scale up at once when utilisation passes ``scale_up_at`` of capacity or latency breaks the SLO; scale
    down one replica at a time, only after load has stayed below ``scale_down_at`` for ``down_delay_s``.
    Capacity per replica is ``capacity_qps`` when known, else the target load divided over the minimum.
    """

    scale_up_at: float = 0.8
    scale_down_at: float = 0.4
    down_delay_s: float = 30.0
    _low_since: dict[str, float] | None = None

    def desired(
        self,
        name: str,
        now: float,
        current: int,
        load: LoadSample,
        *,
        capacity_qps: float,
        slo_ms: float | None,
        min_replicas: int,
        max_replicas: int,
    ) -> int:
        if self._low_since is None:
            self._low_since = {}
        if current <= 0:
            return max(min_replicas, 1 if load.qps > 0 else min_replicas)
        utilisation = load.qps / (capacity_qps * current) if capacity_qps > 0 else 0.0
        slo_broken = slo_ms is not None and load.mean_latency_ms > slo_ms and load.outstanding >= current
        if utilisation > self.scale_up_at or slo_broken:
            self._low_since.pop(name, None)
            wanted = math.ceil(load.qps / (capacity_qps * self.scale_up_at)) if capacity_qps > 0 else current
            return min(max_replicas, max(current + 1, wanted))
        if utilisation < self.scale_down_at and current > min_replicas:
            since = self._low_since.setdefault(name, now)
            if now - since >= self.down_delay_s:
                self._low_since[name] = now  # one step, then wait again
                return max(min_replicas, current - 1)
            return current
        self._low_since.pop(name, None)
        return max(min_replicas, min(current, max_replicas))
