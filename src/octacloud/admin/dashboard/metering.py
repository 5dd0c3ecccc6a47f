"""Metering totals per tenant for the dashboard and ``/metrics``, read incrementally from the usage ledger.

The meter closes intervals in order and records how far it got (``closed_until_ms``); every record of a closed
interval starts before that mark. :class:`LedgerTotals` keeps running integer sums per (tenant, metric) and on
each :meth:`refresh` reads only the records of intervals closed since the last one, so a scrape costs one small
query when nothing new was closed, however long the ledger grows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from octacloud.metering import Ledger
from octacloud.metering import Metric as UsageMetric

METRIC_PREFIX = "octacloud_metering_"
"""Each ledger metric ``m`` is exported as the counter ``octacloud_metering_<m>_total{tenant}``."""
_HELP = {
    UsageMetric.ALLOC: "GPU slice held, milli-GPU × milliseconds (125 000 = one octant-second).",
    UsageMetric.EXEC: "Execution time the tenant's replicas measured, microseconds.",
    UsageMetric.INFERENCES: "Inferences (batch items) the tenant's replicas executed.",
    UsageMetric.REQUESTS: "Requests the gateway received for the tenant's deployments.",
    UsageMetric.BYTES_IN: "Request bytes the gateway received for the tenant.",
    UsageMetric.BYTES_OUT: "Response bytes the gateway sent for the tenant.",
    UsageMetric.STORAGE: "Model bytes stored × milliseconds.",
    UsageMetric.GPU_USED: "GPU the tenant's replicas actually used (NVML SM share), milli-GPU × milliseconds.",
    UsageMetric.PROMPT_TOKENS: "Prompt tokens the tenant sent to generative deployments.",
    UsageMetric.COMPLETION_TOKENS: "Tokens generative deployments generated for the tenant.",
    UsageMetric.ENERGY: "Energy of the tenant's share of its cards' measured draw, millijoules (3 600 000 = 1 Wh).",
}


class LedgerTotals:
    """Running per-tenant totals of the ledger's closed intervals. Safe to call from several threads."""

    def __init__(self, ledger: Ledger, meter: str = "meter") -> None:
        self.ledger = ledger
        self.meter = meter
        self.totals: dict[str, dict[UsageMetric, int]] = {}
        self._until_ms: int | None = None
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            closed = self.ledger.closed_until_ms(self.meter)
            if closed is None or closed == self._until_ms:
                return
            for r in self.ledger.records(since_ms=self._until_ms, until_ms=closed):
                per = self.totals.setdefault(r.tenant, {})
                per[r.metric] = per.get(r.metric, 0) + r.quantity
            self._until_ms = closed

    def usage(self) -> list[dict[str, Any]]:
        """Per tenant, in readable units: what the dashboard's tenant table shows."""
        self.refresh()
        out = []
        for tenant, per in sorted(self.totals.items()):
            out.append(
                {
                    "tenant": tenant,
                    "octant_seconds": round(per.get(UsageMetric.ALLOC, 0) / 125_000, 1),
                    "gpu_used_octant_seconds": round(per.get(UsageMetric.GPU_USED, 0) / 125_000, 1),
                    "exec_seconds": round(per.get(UsageMetric.EXEC, 0) / 1e6, 3),
                    "inferences": per.get(UsageMetric.INFERENCES, 0),
                    "requests": per.get(UsageMetric.REQUESTS, 0),
                    "bytes_in": per.get(UsageMetric.BYTES_IN, 0),
                    "bytes_out": per.get(UsageMetric.BYTES_OUT, 0),
                    "prompt_tokens": per.get(UsageMetric.PROMPT_TOKENS, 0),
                    "completion_tokens": per.get(UsageMetric.COMPLETION_TOKENS, 0),
                    "energy_wh": round(per.get(UsageMetric.ENERGY, 0) / 3_600_000, 3),
                }
            )
        return out

    def metrics(self) -> Iterator[Metric]:
        self.refresh()
        for metric in UsageMetric:
            family = CounterMetricFamily(f"{METRIC_PREFIX}{metric.value}", _HELP[metric], labels=["tenant"])
            for tenant, per in sorted(self.totals.items()):
                if metric in per:
                    family.add_metric([tenant], float(per[metric]))
            yield family
