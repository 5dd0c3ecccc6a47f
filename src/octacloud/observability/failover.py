"""The failover reserve per failure domain as metrics: could each domain's work be re-placed elsewhere now?

At every scrape, for each kind of failure domain the fleet declares (``node`` always; ``rack``, ``power_feed``,
``zone`` where some node declares one), every domain that holds work is lost in a trial
(:func:`octacloud.scheduler.actions.evacuate.domain_coverage`: released and re-placed with the scheduler's own
profile as failover work, in one transaction rolled back before the scrape returns, so nothing else sees it):

* ``octacloud_failure_domain_covered{kind,domain}``: 1 when everything on it could be re-placed, else 0;
* ``octacloud_failure_domain_unplaced_milli{kind,domain}``: the milli-GPU that could not.

A domain that holds no work is covered and not listed. The trial runs on the caller's thread with the
scheduler's state, so call it where the scheduler lives (the cloud's event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octacloud.core.domains import DECLARED_KINDS, declared
from octacloud.scheduler.actions.evacuate import Evacuation, domain_coverage
from octacloud.scheduler.framework.runner import Scheduler


def fleet_coverage(scheduler: Scheduler) -> list[Evacuation]:
    """:func:`domain_coverage` for ``node`` and each declared kind some node of the fleet declares."""
    nodes = scheduler.state.nodes
    kinds = ["node", *(k for k in DECLARED_KINDS if any(declared(n, k) for n in nodes))]
    return [e for kind in kinds for e in domain_coverage(scheduler, kind)]


class FailoverCoverage(Collector):  # type: ignore[misc]
    """The per-domain failover reserve of the scheduler ``source`` returns (see the module docstring)."""

    def __init__(self, source: Callable[[], Scheduler]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        covered = GaugeMetricFamily(
            "octacloud_failure_domain_covered",
            "1 when everything on the failure domain could be re-placed elsewhere now, 0 when some could not.",
            labels=["kind", "domain"],
        )
        unplaced = GaugeMetricFamily(
            "octacloud_failure_domain_unplaced_milli",
            "Milli-GPU on the failure domain that could not be re-placed elsewhere, were it lost now.",
            labels=["kind", "domain"],
        )
        for e in fleet_coverage(self.source()):
            covered.add_metric([e.kind, e.domain], 1.0 if e.covered else 0.0)
            unplaced.add_metric([e.kind, e.domain], float(e.unplaced_gpu_milli))
        yield covered
        yield unplaced
