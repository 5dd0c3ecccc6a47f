"""Which NVML readings make a card unhealthy: the policy that turns XID events, ECC counters, retired pages and a
lost GPU into a card's health, so the scheduler stops placing on it and the controller fails its replicas over.

The verdicts follow NVIDIA's XID catalogue and its guidance on memory errors:

* **FAILED** (replicas move off the card now): the GPU is lost to NVML; XID 48 (double-bit ECC error), 61/62
  (internal micro-controller halt), 64 (page retirement or row remapping failed), 74 (NVLink error), 79 (fallen
  off the bus), 95 (uncontained ECC error), 119/120 (GSP errors), 140 (unrecovered ECC error); the volatile
  double-bit ECC counter rising; a row-remap failure.
* **DEGRADED** (keeps its replicas, receives no new ones): XID 63 (a page retirement or row remap was recorded:
  reset when convenient), 92 (high single-bit ECC rate), 94 (contained ECC error: one application was hit);
  pages pending retirement.
* XIDs that applications cause (13, 31, 43, 45 ...) say nothing about the card and are ignored.

A card's health only worsens here: recovery (after a reset or a repair) is an operator's act, because every
condition above persists until the card is reset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from octacloud.core.model import Health
from octacloud.observability import dcgm

FATAL_XIDS = MappingProxyType(
    {
        48: "double-bit ECC error",
        61: "internal micro-controller breakpoint",
        62: "internal micro-controller halt",
        64: "ECC page retirement or row remapping failure",
        74: "NVLink error",
        79: "GPU has fallen off the bus",
        95: "uncontained ECC error",
        119: "GSP RPC timeout",
        120: "GSP error",
        140: "unrecovered ECC error",
    }
)
DEGRADING_XIDS = MappingProxyType(
    {
        63: "ECC page retirement or row remapping recorded (reset the card when convenient)",
        92: "high single-bit ECC error rate",
        94: "contained ECC error",
    }
)


@dataclass(frozen=True, slots=True)
class CardVerdict:
    """A card's health changed: what it is now and why."""

    node: str
    gpu: int
    health: Health
    reason: str


_RANK = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.FAILED: 2}


def assess(reading: dcgm.CardReading, previous_dbe: float | None) -> tuple[Health, str]:
    """The health one reading shows (``previous_dbe``: the volatile double-bit ECC count seen before)."""
    if reading.lost:
        return Health.FAILED, "NVML reports the GPU lost"
    worst: tuple[Health, str] = (Health.HEALTHY, "")
    for xid in reading.xids:
        if xid in FATAL_XIDS:
            return Health.FAILED, f"XID {xid}: {FATAL_XIDS[xid]}"
        if xid in DEGRADING_XIDS:
            worst = (Health.DEGRADED, f"XID {xid}: {DEGRADING_XIDS[xid]}")
    values = reading.values
    dbe = values.get(dcgm.ECC_DBE)
    if dbe is not None and previous_dbe is not None and dbe > previous_dbe:
        return Health.FAILED, f"{int(dbe - previous_dbe)} new double-bit ECC error(s)"
    if values.get(dcgm.REMAP_FAILURE, 0) > 0:
        return Health.FAILED, "row remapping failed"
    if worst[0] is Health.HEALTHY and values.get(dcgm.RETIRED_PENDING, 0) > 0:
        worst = (Health.DEGRADED, "memory pages pending retirement (reset the card when convenient)")
    return worst


@dataclass(slots=True)
class CardHealthWatch:
    """Follows the readings of one node's cards and reports each card whose health got worse."""

    node: str
    health: dict[int, Health] = field(default_factory=dict)
    _dbe: dict[int, float] = field(default_factory=dict)

    def observe(self, readings: Iterable[dcgm.CardReading]) -> list[CardVerdict]:
        changes = []
        for reading in readings:
            index = reading.card.index
            health, reason = assess(reading, self._dbe.get(index))
            if dcgm.ECC_DBE in reading.values:
                self._dbe[index] = reading.values[dcgm.ECC_DBE]
            was = self.health.get(index, Health.HEALTHY)
            if _RANK[health] > _RANK[was]:
                self.health[index] = health
                changes.append(CardVerdict(self.node, index, health, reason))
        return changes
