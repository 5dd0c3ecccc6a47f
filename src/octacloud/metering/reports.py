"""Usage reports: ledger records summed by tenant and deployment, day or GPU model, with optional cost.

A price sheet (YAML) prices octant-hours by GPU model, gigabytes transferred (in + out), gigabyte-months
stored, and a generative model's tokens per million (prompt and completion apart, as the field prices them)::

    currency: EUR
    octant_hour: {default: 0.10, "NVIDIA H100 80GB HBM3": 0.45}
    gb_transferred: 0.01
    gb_month_stored: 0.02
    prompt_mtok: 0.05
    completion_mtok: 0.20
    kwh: 0.40

Energy (each slice's share of its cards' measured draw) is reported in watt-hours and, with ``kwh``, priced per
kilowatt-hour (what the operator charges tenants; the fleet file's tariffs are what the operator pays, a scheduling
cost).

Units: 1 octant-hour = 125 milli-GPU × 3 600 000 ms; 1 GB = 10^9 bytes; 1 month = 30 days; 1 mtok = 10^6 tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from octacloud.core.errors import InvalidSpecError
from octacloud.metering.ledger import GROUPS, Metric, Total, UsageRecord, day_of

GroupBy = Literal["deployment", "day", "gpu-model", "tenant"]
MILLI_MS_PER_OCTANT_HOUR = 125 * 3_600_000
BYTES_PER_GB = 10**9
TOKENS_PER_MTOK = 10**6
MS_PER_MONTH = 30 * 86_400_000
MJ_PER_WH = 3_600_000


_PRICED = ("gb_transferred", "gb_month_stored", "prompt_mtok", "completion_mtok", "kwh")


@dataclass(frozen=True, slots=True)
class PriceSheet:
    currency: str = "USD"
    octant_hour: dict[str, float] = field(default_factory=dict)
    """GPU model → price; the key ``default`` prices models not listed."""
    gb_transferred: float = 0.0
    gb_month_stored: float = 0.0
    prompt_mtok: float = 0.0
    """Price of a million prompt tokens."""
    completion_mtok: float = 0.0
    """Price of a million generated tokens."""
    kwh: float = 0.0
    """Price of a kilowatt-hour of the energy a tenant's slices drew."""

    @classmethod
    def load(cls, path: Path) -> PriceSheet:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidSpecError(f"price sheet {path}: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "price sheet") -> PriceSheet:
        if not isinstance(data, dict):
            raise InvalidSpecError(f"{where}: expected a mapping")
        unknown = sorted(set(data) - {"currency", "octant_hour", *_PRICED})
        if unknown:
            raise InvalidSpecError(f"{where}: unknown field(s) {unknown}")
        hour = data.get("octant_hour", {})
        if isinstance(hour, int | float):
            hour = {"default": hour}
        if not isinstance(hour, dict) or not all(isinstance(v, int | float) and v >= 0 for v in hour.values()):
            raise InvalidSpecError(f"{where}: octant_hour must be a price or a mapping of GPU model to price >= 0")
        prices = {}
        for name in _PRICED:
            value = data.get(name, 0.0)
            if not isinstance(value, int | float) or value < 0:
                raise InvalidSpecError(f"{where}: {name} must be a number >= 0, got {value!r}")
            prices[name] = float(value)
        return cls(str(data.get("currency", "USD")), {str(k): float(v) for k, v in hour.items()}, **prices)

    def octant_hour_price(self, gpu_model: str) -> float:
        return self.octant_hour.get(gpu_model, self.octant_hour.get("default", 0.0))


@dataclass(slots=True)
class UsageLine:
    """Usage of one tenant in one group, in integer ledger units (see :class:`Metric`)."""

    tenant: str
    group: str
    alloc_milli_ms: int = 0
    exec_us: int = 0
    inferences: int = 0
    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    storage_byte_ms: int = 0
    gpu_used_milli_ms: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    energy_mj: int = 0
    cost: float = 0.0

    @property
    def octant_hours(self) -> float:
        return self.alloc_milli_ms / MILLI_MS_PER_OCTANT_HOUR

    @property
    def octant_seconds(self) -> float:
        return self.alloc_milli_ms / 125_000

    @property
    def watt_hours(self) -> float:
        return self.energy_mj / MJ_PER_WH

    @property
    def gb_months(self) -> float:
        return self.storage_byte_ms / BYTES_PER_GB / MS_PER_MONTH

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "group": self.group,
            "octant_seconds": round(self.octant_seconds, 3),
            "exec_seconds": round(self.exec_us / 1e6, 6),
            "inferences": self.inferences,
            "requests": self.requests,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "storage_gb_months": float(f"{self.gb_months:.6g}"),  # tiny models: keep the significant digits
            "gpu_used_octant_seconds": round(self.gpu_used_milli_ms / 125_000, 3),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "energy_wh": round(self.watt_hours, 6),
            "cost": round(self.cost, 6),
        }


_FIELD = {
    Metric.ALLOC: "alloc_milli_ms",
    Metric.EXEC: "exec_us",
    Metric.INFERENCES: "inferences",
    Metric.REQUESTS: "requests",
    Metric.BYTES_IN: "bytes_in",
    Metric.BYTES_OUT: "bytes_out",
    Metric.STORAGE: "storage_byte_ms",
    Metric.GPU_USED: "gpu_used_milli_ms",
    Metric.PROMPT_TOKENS: "prompt_tokens",
    Metric.COMPLETION_TOKENS: "completion_tokens",
    Metric.ENERGY: "energy_mj",
}


def _group(record: UsageRecord, by: str) -> str:
    if by == "deployment":
        return record.deployment
    if by == "day":
        return day_of(record.interval_start_ms)
    if by == "gpu-model":
        return record.gpu_model or "-"
    if by == "tenant":
        return ""
    raise InvalidSpecError(f"cannot group usage by {by!r}; choose one of {', '.join(GROUPS)}")


def totals_of(records: Iterable[UsageRecord], by: str = "deployment") -> list[Total]:
    """What :meth:`Ledger.totals` computes in the database, computed from records in memory."""
    sums: dict[tuple[str, str, Metric, str], int] = {}
    for r in records:
        key = (r.tenant, _group(r, by), r.metric, r.gpu_model)
        sums[key] = sums.get(key, 0) + r.quantity
    return [Total(*key, quantity) for key, quantity in sums.items()]


def summarize(
    records: Iterable[UsageRecord], by: str = "deployment", prices: PriceSheet | None = None
) -> list[UsageLine]:
    """One line per (tenant, group), sorted; with ``prices``, each line's cost."""
    return summarize_totals(totals_of(records, by), prices)


def summarize_totals(totals: Iterable[Total], prices: PriceSheet | None = None) -> list[UsageLine]:
    lines: dict[tuple[str, str], UsageLine] = {}
    cost: dict[tuple[str, str], float] = {}
    for r in totals:
        key = (r.tenant, r.group)
        line = lines.get(key)
        if line is None:
            line = lines[key] = UsageLine(*key)
        name = _FIELD[r.metric]
        setattr(line, name, getattr(line, name) + r.quantity)
        if prices is not None:
            cost[key] = cost.get(key, 0.0) + _cost(r, prices)
    for key, line in lines.items():
        line.cost = cost.get(key, 0.0)
    return [lines[k] for k in sorted(lines)]


def _cost(r: Total, prices: PriceSheet) -> float:
    if r.metric is Metric.ALLOC:
        return r.quantity / MILLI_MS_PER_OCTANT_HOUR * prices.octant_hour_price(r.gpu_model)
    if r.metric in (Metric.BYTES_IN, Metric.BYTES_OUT):
        return r.quantity / BYTES_PER_GB * prices.gb_transferred
    if r.metric is Metric.STORAGE:
        return r.quantity / BYTES_PER_GB / MS_PER_MONTH * prices.gb_month_stored
    if r.metric is Metric.PROMPT_TOKENS:
        return r.quantity / TOKENS_PER_MTOK * prices.prompt_mtok
    if r.metric is Metric.COMPLETION_TOKENS:
        return r.quantity / TOKENS_PER_MTOK * prices.completion_mtok
    if r.metric is Metric.ENERGY:
        return r.quantity / MJ_PER_WH / 1000 * prices.kwh
    return 0.0


def report(records: Iterable[UsageRecord], by: str = "deployment", prices: PriceSheet | None = None) -> dict[str, Any]:
    return report_totals(totals_of(records, by), by, prices)


def report_totals(totals: Iterable[Total], by: str, prices: PriceSheet | None = None) -> dict[str, Any]:
    """The JSON form served by ``GET /admin/usage`` and printed by ``octacloud usage --format json``."""
    lines = summarize_totals(totals, prices)
    total = UsageLine("*", "total")
    for line in lines:
        for name in (*_FIELD.values(), "cost"):
            setattr(total, name, getattr(total, name) + getattr(line, name))
    return {
        "by": by,
        "currency": prices.currency if prices is not None else None,
        "lines": [line.as_dict() for line in lines],
        "total": total.as_dict(),
    }
