"""Policy: turn a model's profile and a target load into octants per replica and a replica count, and
decide scaling from measured load. Pure functions; no I/O, no clock reads (time is passed in).

Sizing (``--octants auto``):

* memory: a replica needs the model's weights plus ``bytes_per_sample × max_batch`` of activations; the slice's
  share of the card's memory must hold that, and no model may use more than 80 % of a card's memory;
* throughput: the profile gives samples/s on a whole card (or the CPU-card equivalent); a replica on ``k``
  octants serves ``k/8`` of it (MPS splits SMs proportionally; on the CPU the thread budget does);
* the result is the smallest octant count that holds the model, grown (up to one card, or the largest slice
  the fleet can give) while more replicas would be needed than ``max_replicas`` allows.

Every size, asked for or computed, is then checked against what the fleet could ever place
(:class:`FleetCapacity`: the whole fleet empty, the failover reserve kept): a size that can never be placed is
refused with a message naming the largest slice this fleet gives, rather than accepted and left pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from octacloud.control.deployments import DeploymentSpec
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.core.model import Node
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU, max_model_memory_mib
from octacloud.scheduler.framework.runner import Profile
from octacloud.scheduler.plugins.headroom import FailoverHeadroom

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What sizing needs to know about a model (from the toolchain's profile or measured at load)."""

    weights_bytes: int
    bytes_per_sample: int = 0
    max_batch: int = 1
    samples_per_second_per_card: float | None = None
    sequence_tokens: int = 0
    """A generative model's context per sequence (0 for any other model): then ``max_batch`` is the sequences its
    engine decodes at once and ``bytes_per_sample`` the KV cache of one sequence, allocated when it starts."""

    @property
    def generative(self) -> bool:
        return self.sequence_tokens > 0

    def describe_batch(self) -> str:
        """What the memory beyond the weights is for, in the operator's words."""
        extra = self.bytes_per_sample * max(1, self.max_batch) / MIB
        if self.generative:
            return f"{extra:.1f} MiB KV cache for {self.max_batch} sequence(s) × {self.sequence_tokens} tokens"
        return f"{extra:.1f} MiB activations at batch {max(1, self.max_batch)}"

    @property
    def memory_mib(self) -> int:
        return math.ceil((self.weights_bytes + self.bytes_per_sample * max(1, self.max_batch)) / MIB)


@dataclass(frozen=True, slots=True)
class Sizing:
    octants: int
    replicas: int
    memory_mib: int
    reason: str = ""
    """How the size was chosen (footprint, per-octant throughput, target), for the operator."""


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """What the fleet could give one deployment if it were empty: the cards of each node and the share of the
    fleet that normal-priority work may hold (the rest is the failover reserve)."""

    cards: tuple[tuple[int, ...], ...]
    """Per node, the memory (MiB) of each card."""
    reserve_percent: int = 0

    @classmethod
    def of(cls, nodes: Sequence[Node], reserve_percent: int = 0) -> FleetCapacity:
        return cls(tuple(tuple(g.memory_mib for g in n.gpus) for n in nodes), reserve_percent)

    @property
    def card_count(self) -> int:
        return sum(len(c) for c in self.cards)

    @property
    def card_memory_mib(self) -> int:
        """The largest card's memory (0 without cards)."""
        return max((m for c in self.cards for m in c), default=0)

    @property
    def ceiling_milli(self) -> int:
        """Milli-GPU that normal work may hold in all (the reserve kept)."""
        return self.card_count * MILLI_PER_GPU * (100 - self.reserve_percent) // 100

    @property
    def largest_octants(self) -> int:
        """The largest slice one replica can get: octants of one card, or whole cards of one node (8 per card)."""
        ceiling = self.ceiling_milli
        if not self.card_count:
            return 0
        whole = max((n for n in range(2, max(len(c) for c in self.cards) + 1) if n * MILLI_PER_GPU <= ceiling),
                    default=0)  # fmt: skip
        if whole:
            return whole * OCTANTS_PER_GPU
        return min(OCTANTS_PER_GPU, ceiling // MILLI_PER_OCTANT)

    def replicas_that_fit(self, octants: int, memory_mib: int = 0) -> int:
        """How many replicas of ``octants`` octants (each holding ``memory_mib`` per card) the empty fleet holds."""
        if octants <= 0:
            return 0
        if octants <= OCTANTS_PER_GPU:
            slots = OCTANTS_PER_GPU // octants
            per_card = [slots if memory_mib == 0 else min(slots, m // memory_mib) for c in self.cards for m in c]
            return min(sum(per_card), self.ceiling_milli // (octants * MILLI_PER_OCTANT))
        n = octants // OCTANTS_PER_GPU
        per_node = [sum(1 for m in c if m >= memory_mib) // n for c in self.cards]
        return min(sum(per_node), self.ceiling_milli // (n * MILLI_PER_GPU))

    def describe(self) -> str:
        nodes = len(self.cards)
        reserve = f", {self.reserve_percent} % kept for failover" if self.reserve_percent else ""
        return (
            f"this fleet ({nodes} node(s), {self.card_count} card(s){reserve}) gives at most "
            f"{self.largest_octants} octant(s) to one replica"
        )

    def check(self, name: str, octants: int, replicas: int, memory_mib: int = 0) -> None:
        """Raise :class:`InvalidSpecError` unless ``replicas`` × ``octants`` could be placed on the empty fleet."""
        if not self.card_count:
            raise InvalidSpecError(f"deployment {name!r}: the fleet has no cards")
        card = self.card_memory_mib
        if memory_mib > max_model_memory_mib(card):
            raise InvalidSpecError(
                f"deployment {name!r}: the model needs {memory_mib} MiB but a model may use at most 80 % of a "
                f"card's memory ({max_model_memory_mib(card)} of {card} MiB on the largest card); use a smaller "
                "batch, a quantized variant, or bigger cards"
            )
        if octants < OCTANTS_PER_GPU and memory_mib > card * octants // OCTANTS_PER_GPU:
            least = math.ceil(memory_mib * OCTANTS_PER_GPU / card)
            raise InvalidSpecError(
                f"deployment {name!r}: the model needs {memory_mib} MiB but {octants} octant(s) of a {card} MiB card "
                f"hold {card * octants // OCTANTS_PER_GPU} MiB; use --octants {least} or more (or auto)"
            )
        largest = self.largest_octants
        if octants > largest:
            raise InvalidSpecError(
                f"deployment {name!r}: {octants} octant(s) per replica can never be placed: {self.describe()}"
            )
        fit = self.replicas_that_fit(octants, memory_mib)
        if replicas > fit:
            raise InvalidSpecError(
                f"deployment {name!r}: {replicas} replica(s) × {octants} octant(s) can never be placed: at most "
                f"{fit} such replica(s) fit ({self.describe()}); ask for fewer replicas or smaller slices, or add "
                "cards"
            )


def size_deployment(
    footprint: ModelFootprint,
    card_memory_mib: int,
    *,
    target_qps: float | None,
    min_replicas: int,
    max_replicas: int,
    largest_octants: int = OCTANTS_PER_GPU,
) -> Sizing:
    """Octants per replica and replica count for a model on cards of ``card_memory_mib``; slices grow up to
    ``largest_octants`` (at most one card)."""
    need = footprint.memory_mib
    limit = max_model_memory_mib(card_memory_mib)
    if need > limit:
        raise InvalidSpecError(
            f"the model needs {need} MiB but a model may use at most 80 % of a card's memory ({limit} of "
            f"{card_memory_mib} MiB); use a smaller batch, a quantized variant, or bigger cards"
        )
    octants = max(1, math.ceil(need * OCTANTS_PER_GPU / card_memory_mib))
    top = max(octants, min(OCTANTS_PER_GPU, largest_octants))
    memory = (
        f"needs {need} MiB ({footprint.weights_bytes / MIB:.1f} MiB weights + {footprint.describe_batch()}); the "
        f"smallest slice that holds it: {octants} octant(s) of a {card_memory_mib} MiB card"
    )
    per_card = footprint.samples_per_second_per_card
    if target_qps is None or not per_card:
        replicas = max(1, min_replicas)
        why = "no --target-qps" if target_qps is None else "the model has no profile (no throughput figure)"
        return Sizing(octants, replicas, need, f"{memory}; {why}: {replicas} replica(s) × {octants} octant(s)")
    while True:
        capacity = per_card * octants / OCTANTS_PER_GPU
        replicas = max(min_replicas, 1, math.ceil(target_qps / capacity))
        if replicas <= max_replicas or octants >= top:
            short = (
                f"; short of the target: it needs {replicas}, raise --max-replicas" if replicas > max_replicas else ""
            )
            replicas = min(replicas, max_replicas)
            reason = (
                f"{memory}; {per_card / OCTANTS_PER_GPU:.1f} samples/s per octant (profile: {per_card:.0f}/s per "
                f"card); target {target_qps:g} req/s → {replicas} replica(s) × {octants} octant(s) serve "
                f"{replicas * capacity:.0f}/s (max {max_replicas} replica(s){short})"
            )
            return Sizing(octants, replicas, need, reason)
        octants += 1


GENERATIVE_QUEUE = 4
"""A generative deployment's in-flight bound per replica, in engine sequences: each slot and three waiting."""


def inflight_per_replica(footprint: Callable[[], ModelFootprint]) -> int | None:
    """The gateway's in-flight bound per replica for a generative deployment (a generation holds an engine slot
    for seconds, so the default bound of a batching model would refuse what a slot frees for in a moment);
    None for any other model (the gateway's default applies)."""
    try:
        found = footprint()
    except (NotFoundError, InvalidSpecError):
        return None
    return found.max_batch * GENERATIVE_QUEUE if found.generative else None


def reserve_percent(profile: Profile, priority: int) -> int:
    """The failover reserve ``profile`` keeps from work of ``priority`` (0 without the headroom rule)."""
    for plugin in profile.plugins():
        if isinstance(plugin, FailoverHeadroom):
            return 0 if priority >= plugin.high_priority else plugin.percent
    return 0


def plan_size(spec: DeploymentSpec, footprint: Callable[[], ModelFootprint], capacity: FleetCapacity) -> Sizing:
    """The size ``spec`` resolves to (auto-sizing done), checked against what ``capacity`` could ever place.

    ``footprint`` is asked for the model's footprint; auto-sizing needs it, an explicit size uses it (when the
    model has one) to check the memory rules. Raises :class:`InvalidSpecError` naming what can never be placed.
    """
    if spec.octants is not None:
        try:
            memory = footprint().memory_mib
        except (NotFoundError, InvalidSpecError):
            memory = 0
        replicas = max(spec.min_replicas, 1) if spec.max_replicas else 0
        sizing = Sizing(spec.octants, replicas, memory)
    else:
        if not capacity.card_count:
            raise InvalidSpecError("the fleet has no cards to size a deployment for")
        sizing = size_deployment(
            footprint(),
            capacity.card_memory_mib,
            target_qps=spec.target_qps,
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            largest_octants=capacity.largest_octants,
        )
    capacity.check(spec.name, sizing.octants, sizing.replicas, sizing.memory_mib)
    return sizing


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
