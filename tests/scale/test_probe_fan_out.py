"""A fleet's readiness probes go out a bounded number at a time: all at once, they wait in the replicas' queues
past their timeout, and healthy replicas are failed and restarted."""

from __future__ import annotations

import asyncio
from pathlib import Path

from octacloud.control.controller import Probe
from octacloud.control.controller.health import PROBES_AT_ONCE
from octacloud.control.deployments import Replica, ReplicaState
from tests.cluster.controller_fakes import FakeProber, Harness, fleet


class CountingProber(FakeProber):
    """Ready, once it has yielded to the loop; counts the probes in flight."""

    in_flight = 0
    most = 0

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        return Probe(True)


async def test_a_fleets_probes_are_in_flight_a_bounded_number_at_a_time(tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=fleet(nodes=40, cards=8))
    h.prober = prober = CountingProber()
    h.controller = h.make()
    each = 3 * PROBES_AT_ONCE // 2
    for name in ("a", "b"):
        h.deploy(name, octants=1, replicas=each)
    await h.reconcile()
    assert len([r for r in h.replicas() if r.state is ReplicaState.STARTING]) == 2 * each
    await h.health()
    assert prober.most == PROBES_AT_ONCE and prober.in_flight == 0
    assert all(len(h.ready(name)) == len(h.routed(name)) == each for name in ("a", "b"))
