"""Readiness probes spread over their interval: a READY replica is probed once every ``ready_probe_interval_s``
at a phase of its own, a starting one and one whose latest probe failed at every health check; a replica is
failed after the same failed probes in a row, and one whose process exits at the next check."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from octacloud.control.controller import Probe
from octacloud.control.deployments import Replica, ReplicaState
from tests.cluster.controller_fakes import FakeProber, Harness, fleet


class CountingProber(FakeProber):
    """As FakeProber; counts the probes of each replica."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe:
        self.count[replica.id] += 1
        return await super().probe(replica, model, timeout)


def harness(tmp_path: Path) -> tuple[Harness, CountingProber]:
    h = Harness(tmp_path, nodes=fleet(nodes=8, cards=8))
    h.prober = prober = CountingProber()
    h.controller = h.make()
    return h, prober


def one(h: Harness, replica_id: str) -> Replica:
    [r] = [r for r in h.replicas() if r.id == replica_id]
    return r


async def ready_fleet(h: Harness, **deployments: int) -> None:
    for name, replicas in deployments.items():
        h.deploy(name, octants=1, replicas=replicas, tenant=name)
    await h.reconcile()
    await h.health()
    assert all(len(h.ready(name)) == n for name, n in deployments.items())


async def test_a_fleets_ready_probes_are_spread_over_the_interval(tmp_path: Path) -> None:
    h, prober = harness(tmp_path)
    s = h.controller.settings
    await ready_fleet(h, a=60, b=40)  # two tenants' deployments
    prober.count.clear()
    checks = round(s.ready_probe_interval_s / s.health_interval_s)
    per_check = []
    for _ in range(2 * checks):  # two whole intervals
        h.clock.advance(s.health_interval_s)
        before = prober.count.total()
        await h.health()
        per_check.append(prober.count.total() - before)
    assert set(prober.count.values()) == {2}, prober.count  # each READY replica twice, none more often
    assert len(prober.count) == 100
    assert max(per_check) <= 30, per_check  # spread: no check probes the whole fleet (a tenth each, on average)
    assert all(len(h.ready(name)) == len(h.routed(name)) for name in ("a", "b"))


async def test_a_failing_ready_replica_is_probed_every_check_and_failed_as_before(tmp_path: Path) -> None:
    h, prober = harness(tmp_path)
    s = h.controller.settings
    await ready_fleet(h, a=10, b=10)
    victim = h.ready("a")[0]
    prober.answers[victim.id] = Probe(False)
    checks = 0
    while one(h, victim.id).state is ReplicaState.READY:  # its turn comes within one interval
        assert checks <= s.ready_probe_interval_s / s.health_interval_s + s.probe_failures_to_fail
        h.clock.advance(s.health_interval_s)
        prober.count.clear()
        await h.health()
        checks += 1
        if one(h, victim.id).state is ReplicaState.READY and prober.count[victim.id]:
            break  # its first failed probe
    for _ in range(s.probe_failures_to_fail - 1):  # then a probe at every check, to the same count
        assert one(h, victim.id).state is ReplicaState.READY
        h.clock.advance(s.health_interval_s)
        prober.count.clear()
        await h.health()
        assert prober.count[victim.id] == 1
    failed = one(h, victim.id)
    assert failed.state is ReplicaState.FAILED and "readiness probes failed" in failed.message
    assert victim.id not in h.routed("a")
    assert len(h.ready("b")) == 10  # the other tenant's replicas are untouched


async def test_a_replica_that_passes_again_goes_back_to_its_turn(tmp_path: Path) -> None:
    h, prober = harness(tmp_path)
    s = h.controller.settings
    await ready_fleet(h, a=4)
    flaky = h.ready("a")[0]
    prober.answers[flaky.id] = Probe(False)
    while not prober.count[flaky.id]:
        h.clock.advance(s.health_interval_s)
        await h.health()
    del prober.answers[flaky.id]  # one failed probe, then it answers again
    h.clock.advance(s.health_interval_s)
    await h.health()
    assert one(h, flaky.id).state is ReplicaState.READY
    prober.count.clear()
    for _ in range(round(s.ready_probe_interval_s / s.health_interval_s)):  # one whole interval
        h.clock.advance(s.health_interval_s)
        await h.health()
    assert prober.count[flaky.id] == 1 and set(prober.count.values()) == {1}  # once at its turn, as the others


async def test_kill_9_is_seen_at_the_next_check_not_at_the_probes_turn(tmp_path: Path) -> None:
    h, prober = harness(tmp_path)
    await ready_fleet(h, a=8)
    victim = h.ready("a")[0]
    prober.count.clear()
    h.launcher.crash(victim.id)
    h.clock.advance(h.controller.settings.health_interval_s)
    await h.health()
    assert one(h, victim.id).state is ReplicaState.FAILED
    assert victim.id not in h.routed("a")


async def test_an_interval_of_zero_probes_every_ready_replica_at_every_check(tmp_path: Path) -> None:
    h, prober = harness(tmp_path)
    h.controller.settings.ready_probe_interval_s = 0.0
    await ready_fleet(h, a=5)
    prober.count.clear()
    for _ in range(3):
        h.clock.advance(h.controller.settings.health_interval_s)
        await h.health()
    assert set(prober.count.values()) == {3} and len(prober.count) == 5


async def test_a_replica_the_gateway_ejects_is_probed_at_the_next_check(tmp_path: Path) -> None:
    """Its readmission (a probe that passes) does not wait for its turn; the others keep theirs."""
    h, prober = harness(tmp_path)
    s = h.controller.settings
    await ready_fleet(h, a=6)
    h.clock.advance(s.health_interval_s)
    await h.health()
    prober.count.clear()
    await h.health()  # the same instant: nobody's turn again
    assert not prober.count
    [e, *_] = h.routes.routes["a"]
    for _ in range(3):
        h.routes.failed(e)  # transport failures in a row at the gateway: ejected
    await h.health()
    assert dict(prober.count) == {e.replica_id: 1}
