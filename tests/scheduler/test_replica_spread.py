"""Replicas apart, as tables of declared topologies: where the next replica of a group goes, or why it waits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octacloud.core import InvalidSpecError, Node, Request
from octacloud.core.domains import domain_labels, domain_of
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.loop import ReevaluationLoop
from octacloud.scheduler.policies import build_profile, cloud_profile
from tests.scheduler.helpers import node, place, req

WORKLOAD = TargetWorkload((WorkloadShape(1000, 125, 1),), (1.0,))


def fleet(topology: str) -> list[Node]:
    """``"a:r1 b:r1 c:r2 d"``: nodes of two T4 cards, each in the rack after its colon (none: undeclared)."""
    out = []
    for item in topology.split():
        name, _, rack = item.partition(":")
        out.append(replace(node(name), labels=domain_labels(rack=rack)))
    return out


def replica(name: str, group: str = "mlp", spread: str = "soft", milli: int = 125) -> Request:
    return replace(req(name, milli), group=group, spread=spread)


def scheduler(topology: str, placed: str, *, profile: str = "octacloud", rules: bool = True) -> Scheduler:
    """``placed``: ``"a b b"`` puts replicas mlp-0 on a, mlp-1 and mlp-2 on b (card 0); ``x@a`` is a replica of
    another deployment x."""
    state = ClusterState(fleet(topology))
    for k, where in enumerate(placed.split()):
        group, _, at = where.rpartition("@")
        place(state, replica(f"{group or 'mlp'}-{k}", group or "mlp"), at, (0,))
    return Scheduler(state, build_profile(profile, seed=0, workload=WORKLOAD, rules=rules))


@pytest.mark.parametrize(
    ("topology", "placed", "spread", "expected"),
    [
        # The case: after `scale mlp 2` both replicas ran on demo-a while demo-b held nothing.
        ("demo-a demo-b", "demo-a", "soft", {"demo-b"}),
        ("a:r1 b:r1 c:r2", "a", "soft", {"c"}),  # another node, and another rack first
        ("a:r1 b:r1 c:r2", "a c", "soft", {"b"}),  # every rack holds one: the node without any
        ("a b", "a b", "soft", {"a", "b"}),  # two nodes, three replicas: soft still places it
        ("a:r1 b:r1", "a", "rack", set()),  # hard per rack: the only rack is taken, it waits
        ("a:r1 b:r1 c:r2", "a", "rack", {"c"}),
        ("a b", "a b", "node", set()),  # hard per node: each node holds one, it waits
        ("a b c", "a b", "node", {"c"}),
        ("a b", "x@a x@b x@b", "soft", {"a", "b"}),  # another deployment's replicas do not count
        ("a:r1 b", "a", "rack", {"b"}),  # b declares no rack: a rack of its own
    ],
)
def test_where_the_next_replica_goes(topology: str, placed: str, spread: str, expected: set[str]) -> None:
    s = scheduler(topology, placed)
    decision = s.decide(replica("mlp-new", spread=spread))
    got = {decision.placement.node} if decision.placement is not None else set()
    if len(expected) > 1:
        assert got <= expected and got, decision.explain()
    else:
        assert got == expected, decision.explain()
    if not expected:
        assert "replica-spread" in decision.explain()


def test_soft_never_puts_every_replica_on_one_node_while_another_fits() -> None:
    """The default rule holds even where the other node is worse for packing (it holds other work)."""
    s = scheduler("a b", "x@b x@b x@b")  # b is busy with another deployment's replicas; packing would pick b
    first = s.schedule(replica("mlp-0"))
    second = s.schedule(replica("mlp-1"))
    assert first.placement is not None and second.placement is not None
    assert first.placement.node != second.placement.node


def test_soft_shares_a_node_when_no_other_node_fits() -> None:
    s = scheduler("a b", "")
    assert s.schedule(req("big", 1000, cards=2)).placement is not None  # fills one node whole
    first, second = s.schedule(replica("mlp-0")), s.schedule(replica("mlp-1"))
    assert first.placement is not None and second.placement is not None
    assert first.placement.node == second.placement.node  # the only node with room: better than waiting


def test_a_replica_being_placed_again_does_not_count_against_itself() -> None:
    s = scheduler("a b", "a")
    own = s.state.allocations["mlp-0"].request
    assert s.decide(replace(own, spread="node")).placement is not None


def test_the_index_follows_releases_and_failures() -> None:
    s = scheduler("a b c", "a b")
    assert s.decide(replica("n", spread="node")).placement.node == "c"  # type: ignore[union-attr]
    s.release("mlp-1")
    assert s.decide(replica("n", spread="node")).placement.node in {"b", "c"}  # type: ignore[union-attr]


def test_requests_without_a_group_are_left_alone_and_the_index_path_stays() -> None:
    s = scheduler("a b", "a")
    decision = s.decide(req("plain", 125))
    assert decision.placement is not None and decision.placement.node == "a"  # packing: with what is there


def test_the_same_decisions_with_and_without_the_rules_and_in_every_product_profile() -> None:
    for profile in ("octacloud", "spread"):
        for rules in (True, False):
            s = scheduler("a:r1 b:r1 c:r2", "a", profile=profile, rules=rules)
            assert s.decide(replica("mlp-new")).placement.node == "c", (profile, rules)  # type: ignore[union-attr]


def test_a_bad_spread_is_refused_by_name() -> None:
    with pytest.raises(InvalidSpecError, match=r"request r: spread must be one of \['soft', 'node', 'rack'\]"):
        Request("r", spread="zone")


def test_the_loop_keeps_a_hard_spread_through_defragmentation_and_its_shape_cache() -> None:
    """A pass neither pairs a share onto a sibling's rack nor skips a group because another group failed."""
    state = ClusterState([replace(n, gpus=n.gpus[:1]) for n in fleet("a:r1 b:r1 c:r2")])
    loop = ReevaluationLoop(Scheduler(state, cloud_profile("octacloud")))
    per_rack = [replica(f"r{k}", group="per-rack", spread="rack") for k in range(3)]
    per_node = [replica(f"n{k}", group="per-node", spread="node") for k in range(4)]
    soft = [replica(f"s{k}", group="soft") for k in range(4)]
    report = loop.run_pass(0.0, [*per_node, *per_rack, *soft])
    where = {name: a.node_index for name, a in state.allocations.items()}
    rack = [domain_of(n, "rack") for n in state.nodes]
    assert sorted(rack[where[r.name]] for r in per_rack if r.name in where) == ["r1", "r2"]
    assert len({where[r.name] for r in per_node if r.name in where}) == 3 == sum(r.name in where for r in per_node)
    assert all(r.name in where for r in soft) and {where[r.name] for r in soft} == {0, 1, 2}
    assert not report.moves
    assert sorted(r.name for r in report.pending) == ["n3", "r2"]
