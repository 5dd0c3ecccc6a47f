"""The failover reserve per failure domain, as tables of declared topologies: could each rack's work be re-placed
if it failed now (evacuate, rolled back), and does domain-aware placement keep that true where plain packing
does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octacloud.core.domains import domain_labels, group_by_domain
from octacloud.scheduler.actions.evacuate import domain_coverage, evacuate
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req, snapshot

WORKLOAD = TargetWorkload((WorkloadShape(1000, 1000, 1),), (1.0,))


def fleet(racks: str, cards: int = 2) -> ClusterState:
    """``"r1:2 r2:2"``: two nodes in rack r1 and two in r2, each with ``cards`` cards."""
    nodes = []
    for item in racks.split():
        rack, _, count = item.partition(":")
        for k in range(int(count)):
            nodes.append(replace(node(f"{rack}-n{k}", cards), labels=domain_labels(rack=rack)))
    return ClusterState(nodes)


def scheduler(state: ClusterState, policy: str) -> Scheduler:
    return Scheduler(state, build_profile(policy, seed=0, workload=WORKLOAD))


@pytest.mark.parametrize(
    ("racks", "placed", "covered"),
    [
        # rack r1 full, r2 empty: r1's work fits on r2
        ("r1:1 r2:1", [("a", "r1-n0", 1000), ("b", "r1-n0", 1000)], {"r1": True}),
        # both racks full: neither can be re-placed
        ("r1:1 r2:1", [("a", "r1-n0", 1000), ("b", "r1-n0", 1000), ("c", "r2-n0", 1000), ("d", "r2-n0", 1000)],
         {"r1": False, "r2": False}),
        # half of each: each one's work fits on the other's free card
        ("r1:1 r2:1", [("a", "r1-n0", 1000), ("c", "r2-n0", 1000)], {"r1": True, "r2": True}),
        # a share of 500 on r1; r2 has 750 free, but 375 on each card: the shape decides, r1 is not covered
        ("r1:1 r2:1", [("a", "r1-n0", 500), ("b", "r2-n0", 625), ("c", "r2-n0", 625)], {"r1": False, "r2": False}),
        # the same with r2's shares at 500: r1's 500 fits on either of r2's cards, r2's two on r1's free card
        ("r1:1 r2:1", [("a", "r1-n0", 500), ("b", "r2-n0", 500), ("c", "r2-n0", 500)], {"r1": True, "r2": True}),
    ],
)  # fmt: skip
def test_coverage_of_declared_topologies(
    racks: str, placed: list[tuple[str, str, int]], covered: dict[str, bool]
) -> None:
    state = fleet(racks)
    for k, (name, at, milli) in enumerate(placed):
        cards = [k % 2] if milli < 1000 else [g for g in range(2) if state.free_gpu[state.index[at]][g] == 1000][:1]
        place(state, req(name, milli), at, cards)
    s = scheduler(state, "octacloud")
    before = snapshot(state)
    got = {e.domain: e.covered for e in domain_coverage(s, "rack")}
    assert got == covered
    assert snapshot(state) == before  # every trial rolled back


def test_an_evacuation_committed_re_places_as_failover_work() -> None:
    state = fleet("r1:1 r2:1")
    place(state, req("a", 1000), "r1-n0", [0])
    place(state, req("b", 250), "r1-n0", [1])
    s = scheduler(state, "octacloud")
    e = evacuate(s, group_by_domain(state.nodes, "rack")["r1"], kind="rack", domain="r1", commit=True)
    assert e.covered and e.unplaced_share == 0.0 and e.lost_gpu_milli == 1250
    assert {a.node_index for a in state.allocations.values()} == {1}
    assert all(a.request.failover for a in state.allocations.values())
    check_invariants(state)


def fill(s: Scheduler, shapes: list[int], rounds: int) -> int:
    placed = 0
    for k in range(rounds):
        for j, milli in enumerate(shapes):
            placed += s.schedule(req(f"p{k}-{j}", milli)).placed
    return placed


@pytest.mark.parametrize("racks", ["r1:2 r2:2 r3:2", "r1:1 r2:1 r3:1 r4:1", "r1:3 r2:1 r3:2"])
def test_domain_aware_keeps_every_rack_re_placeable_where_packing_does_not(racks: str) -> None:
    outcome = {}
    for policy in ("octacloud", "domain-aware"):
        state = fleet(racks)
        s = scheduler(state, policy)
        placed = fill(s, [1000, 500, 250, 1000], rounds=20)
        check_invariants(state)
        coverage = domain_coverage(s, "rack")
        outcome[policy] = (placed, all(e.covered for e in coverage), state.utilisation())
    assert outcome["domain-aware"][1], outcome  # every rack re-placeable
    assert not outcome["octacloud"][1], outcome  # packing to the brim leaves some rack without a home
    assert outcome["domain-aware"][2] < outcome["octacloud"][2]  # the reserve costs allocation


def test_the_reserve_steps_aside_for_failover_and_high_priority_work() -> None:
    state = fleet("r1:1 r2:1")
    s = scheduler(state, "domain-aware")
    assert fill(s, [1000], rounds=4) == 2  # one card per rack for work, one kept as the other rack's backup
    assert s.schedule(req("vip", 1000, priority=100)).placed
    assert s.schedule(req("back", 1000, failover=True)).placed
    check_invariants(state)


def test_one_domain_has_nothing_to_keep() -> None:
    state = fleet("r1:2")
    s = scheduler(state, "domain-aware")
    assert fill(s, [1000], rounds=4) == 4


def test_the_coverage_is_exported_per_kind_and_domain_and_the_scrape_changes_nothing() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from octacloud.observability.failover import FailoverCoverage
    from tests.observability.test_exporter import documented

    state = fleet("r1:1 r2:1")
    place(state, req("a", 1000), "r1-n0", [0])
    place(state, req("b", 1000), "r1-n0", [1])
    place(state, req("c", 500), "r2-n0", [0])
    s = scheduler(state, "octacloud")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FailoverCoverage(lambda: s))
    before = snapshot(state)
    text = generate_latest(registry).decode()
    assert snapshot(state) == before
    assert 'octacloud_failure_domain_covered{domain="r1",kind="rack"} 0.0' in text  # two cards; r2 has 1.5 free
    assert 'octacloud_failure_domain_unplaced_milli{domain="r1",kind="rack"} 1000.0' in text
    assert 'octacloud_failure_domain_unplaced_milli{domain="r2",kind="rack"} 500.0' in text  # r1 is full
    assert 'octacloud_failure_domain_covered{domain="r1-n0",kind="node"} 0.0' in text
    assert 'kind="zone"' not in text  # no node declares a zone
    docs = documented()
    for family in registry.collect():
        assert docs.get(family.name) == {"kind", "domain"}, f"{family.name}: not in docs/monitoring.md as exported"
    s.release("b")
    text = generate_latest(registry).decode()
    assert 'octacloud_failure_domain_covered{domain="r1",kind="rack"} 1.0' in text
    assert 'octacloud_failure_domain_covered{domain="r2",kind="rack"} 1.0' in text


def test_a_plan_made_again_at_once_counts_its_changes_from_zero() -> None:
    """The rule makes the plan again only after ``replan_after`` backups were chosen one by one since: a replan's
    own backups must not count, or every refusal on a full fleet would make it again (a walk over the fleet)."""
    from octacloud.scheduler.actions.backup import BackupPlan

    state = fleet("r1:2 r2:2")
    for k, at in enumerate(["r1-n0", "r1-n1", "r2-n0"]):
        place(state, req(f"a{k}", 500), at, [0])
    plan = BackupPlan(state, "rack")
    plan.sync()
    assert plan.changes == 3 and plan.covered()
    plan.replan()
    assert plan.changes == 0 and plan.covered() and len(plan.backups) == 3
    place(state, req("late", 500), "r2-n1", [0])
    plan.sync()
    assert 1 <= plan.changes <= 3 and plan.covered()  # its own backup, and any it moved off its node


def test_a_new_backup_takes_a_nodes_leftovers_not_a_whole_free_node() -> None:
    """A backup that can go to either a node's last free card or a whole free node takes the card: the whole node
    stays free for work that needs all of it (a two-card request here), which a reserve there would keep out."""
    from octacloud.scheduler.actions.backup import BackupPlan

    state = fleet("r1:1 r2:2")
    place(state, req("used", 1000), "r2-n0", [0])
    place(state, req("a", 1000), "r1-n0", [0])
    plan = BackupPlan(state, "rack")
    plan.sync()
    assert plan.covered()
    assert state.nodes[plan.backups["a"].node].name == "r2-n0"  # its last free card, not r2-n1
    assert plan.admits(req("two", 1000, 2), state.index["r2-n1"])  # nothing of r2-n1 is reserved
