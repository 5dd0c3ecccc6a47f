"""octacloud.metering: the usage ledger (append-only, idempotent records), the meter that fills it, and
reports with an optional price sheet. Sits beside protocols and sim: it reads what the cluster measures
through the :class:`UsageSource` protocol and never imports the cluster."""

from __future__ import annotations

from octacloud.metering.ledger import GROUPS, Ledger, Metric, Total, UsageRecord
from octacloud.metering.meter import Allocation, Meter, Stored, Traffic, UsageSource, Work
from octacloud.metering.reports import (
    PriceSheet,
    UsageLine,
    report,
    report_totals,
    summarize,
    summarize_totals,
    totals_of,
)

__all__ = [
    "GROUPS",
    "Allocation",
    "Ledger",
    "Meter",
    "Metric",
    "PriceSheet",
    "Stored",
    "Total",
    "Traffic",
    "UsageLine",
    "UsageRecord",
    "UsageSource",
    "Work",
    "report",
    "report_totals",
    "summarize",
    "summarize_totals",
    "totals_of",
]
