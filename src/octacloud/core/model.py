"""The pure domain: nodes with GPUs, requests for GPU capacity, and placements.

Everything here is immutable and validated at construction; mutable accounting of what is free lives in
``octacloud.scheduler.framework.state``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from octacloud.core.errors import InvalidSpecError
from octacloud.core.units import MILLI_PER_GPU


class Health(enum.Enum):
    """Health of a node or a card, as the fleet's health checks last saw it."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"  # usable, but should not receive new work (e.g. rising ECC errors)
    FAILED = "failed"


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidSpecError(what)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical card of a node."""

    index: int
    model: str
    memory_mib: int
    nvlink_group: int | None = None
    """Cards of one node with the same group are linked by NVLink (``None``: PCIe only)."""
    health: Health = Health.HEALTHY

    def __post_init__(self) -> None:
        _require(self.index >= 0, f"GPU index must be >= 0, got {self.index}")
        _require(self.memory_mib >= 0, f"GPU {self.index}: memory_mib must be >= 0, got {self.memory_mib}")


def _frozen_labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(labels))


@dataclass(frozen=True, slots=True)
class Node:
    """A bare-metal server: CPU, memory and 0–16 GPUs."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[Gpu, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    health: Health = Health.HEALTHY

    def __post_init__(self) -> None:
        _require(bool(self.name), "node name must not be empty")
        _require(self.cpu_milli >= 0, f"node {self.name}: cpu_milli must be >= 0, got {self.cpu_milli}")
        _require(self.memory_mib >= 0, f"node {self.name}: memory_mib must be >= 0, got {self.memory_mib}")
        _require(len(self.gpus) <= 16, f"node {self.name}: at most 16 GPUs per node, got {len(self.gpus)}")
        indices = [g.index for g in self.gpus]
        _require(
            indices == list(range(len(self.gpus))),
            f"node {self.name}: GPU indices must be 0..{len(self.gpus) - 1} in order, got {indices}",
        )
        object.__setattr__(self, "labels", _frozen_labels(self.labels))

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_model(self) -> str:
        """The model of the node's cards ('' when it has none; nodes are homogeneous in practice)."""
        return self.gpus[0].model if self.gpus else ""

    @property
    def gpu_milli(self) -> int:
        return len(self.gpus) * MILLI_PER_GPU


SPREAD_SOFT = "soft"
SPREAD_MODES: tuple[str, ...] = (SPREAD_SOFT, "node", "rack")
"""How a group's replicas are kept apart: ``soft`` prefers other nodes, then other racks, and never puts every
replica of a group of two or more on one node while another node fits; ``node`` (hard) allows one replica per
node, ``rack`` (hard) one per rack; a replica that cannot be kept apart so waits."""


@dataclass(frozen=True, slots=True)
class Request:
    """A request for GPU capacity: ``num_gpu`` cards of ``gpu_milli`` each.

    ``gpu_milli`` < 1000 (a share of a card) is only allowed with one card; several cards are always whole.
    ``gpu_memory_mib`` is per card. ``gpu_models`` empty means any model.
    """

    name: str
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_models: frozenset[str] = frozenset()
    priority: int = 0
    owner: str = ""
    pinned: bool = False
    """Pinned work is never moved by defragmentation."""
    failover: bool = False
    """Replacement of work lost to a failure: may use the failover headroom."""
    model: str = ""
    """The model the work runs ('' for none): cache-aware placement prefers nodes that already hold it."""
    group: str = ""
    """The deployment whose replica this is ('' for none): the replicas of one group are kept apart."""
    spread: str = SPREAD_SOFT
    """How far apart the group's replicas must be (:data:`SPREAD_MODES`)."""

    def __post_init__(self) -> None:
        n = self.name or "<unnamed>"
        _require(
            self.spread in SPREAD_MODES, f"request {n}: spread must be one of {list(SPREAD_MODES)}, got {self.spread!r}"
        )
        _require(0 <= self.num_gpu <= 16, f"request {n}: num_gpu must be 0..16, got {self.num_gpu}")
        _require(
            0 <= self.gpu_milli <= MILLI_PER_GPU,
            f"request {n}: gpu_milli must be 0..{MILLI_PER_GPU}, got {self.gpu_milli}",
        )
        _require(
            (self.num_gpu == 0) == (self.gpu_milli == 0),
            f"request {n}: num_gpu={self.num_gpu} and gpu_milli={self.gpu_milli} must both be 0 or both > 0",
        )
        _require(
            self.num_gpu <= 1 or self.gpu_milli == MILLI_PER_GPU,
            f"request {n}: a request for {self.num_gpu} cards must take whole cards (gpu_milli=1000), "
            f"got gpu_milli={self.gpu_milli}",
        )
        for what in ("gpu_memory_mib", "cpu_milli", "memory_mib"):
            value = getattr(self, what)
            _require(value >= 0, f"request {n}: {what} must be >= 0, got {value}")
        if not isinstance(self.gpu_models, frozenset):
            object.__setattr__(self, "gpu_models", frozenset(self.gpu_models))

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def is_sharing(self) -> bool:
        """True when the request takes a share (< 1 card) of one card."""
        return self.num_gpu == 1 and self.gpu_milli < MILLI_PER_GPU

    def allows_model(self, model: str) -> bool:
        return not self.gpu_models or model in self.gpu_models


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: a node, the card indices, and the milli-GPU taken on each card."""

    request: str
    node: str
    gpus: tuple[int, ...] = ()
    milli_per_gpu: int = 0

    @property
    def total_gpu_milli(self) -> int:
        return len(self.gpus) * self.milli_per_gpu
