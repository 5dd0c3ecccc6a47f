"""Metering totals read incrementally from the ledger: each closed interval is counted once."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.core import Metric

from octacloud.admin.dashboard.metering import LedgerTotals
from octacloud.metering import Ledger, UsageRecord
from octacloud.metering import Metric as UsageMetric


def interval(start: int, tenant: str, alloc: int, requests: int) -> list[UsageRecord]:
    return [
        UsageRecord(tenant, "chat", "chat-1", UsageMetric.ALLOC, start, 10_000, alloc),
        UsageRecord(tenant, "chat", "", UsageMetric.REQUESTS, start, 10_000, requests),
    ]


def samples(families: list[Metric]) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["tenant"]): s.value for f in families for s in f.samples}


def test_totals_count_each_closed_interval_once(tmp_path: Path) -> None:
    ledger = Ledger.at(f"sqlite:///{tmp_path / 'ledger.db'}")
    totals = LedgerTotals(ledger)
    assert totals.usage() == []
    ledger.append(interval(0, "acme", 1_250_000, 7) + interval(0, "globex", 125_000, 1), closed_until_ms=10_000)
    assert [u["octant_seconds"] for u in totals.usage()] == [10.0, 1.0]
    ledger.append(interval(10_000, "acme", 1_250_000, 3), closed_until_ms=20_000)
    ledger.append(interval(10_000, "acme", 1_250_000, 3), closed_until_ms=20_000)  # a replay adds nothing
    acme = totals.usage()[0]
    assert (acme["tenant"], acme["octant_seconds"], acme["requests"]) == ("acme", 20.0, 10)
    got = samples(list(totals.metrics()))
    assert got[("octacloud_metering_alloc_milli_ms_total", "acme")] == 2_500_000
    assert got[("octacloud_metering_requests_total", "globex")] == 1
    # a second reader starting late sees the same totals (it reads the whole ledger once)
    assert LedgerTotals(ledger).usage() == totals.usage()
    ledger.close()
