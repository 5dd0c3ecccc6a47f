"""Replicas apart in the live controller (the cloud's own profile): the issue's `scale mlp 2`, hard spreads that
wait, a second tenant, a malformed spec, and a controller restart in the middle."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from octacloud.control.deployments import DeploymentSpec, ReplicaState
from octacloud.core.domains import domain_labels
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node

from .controller_fakes import Harness, fleet


def racks(*names: str) -> list[Node]:
    """One node of one T4 per name, in the rack given after the colon."""
    nodes = fleet(len(names))
    return [replace(n, labels=domain_labels(rack=r)) for n, r in zip(nodes, names, strict=True)]


async def test_scale_to_two_puts_the_second_replica_on_the_other_node(tmp_path: Path) -> None:
    h = Harness(tmp_path, fleet(2, cards=1), policy="octacloud")
    h.controller.deploy(DeploymentSpec("mlp", "m", octants=1, min_replicas=1, max_replicas=2))
    await h.reconcile()
    h.controller.scale("mlp", 2)
    await h.reconcile()
    nodes = sorted(r.node for r in h.replicas("mlp"))
    assert nodes == ["n0", "n1"]  # not both on n0's card 0 while n1 holds nothing


async def test_hard_spreads_wait_rather_than_share_and_soft_shares_when_it_must(tmp_path: Path) -> None:
    h = Harness(tmp_path, racks("r1", "r1", "r2"), policy="octacloud")
    h.deploy("per-rack", octants=1, replicas=3, spread="rack")
    h.deploy("per-node", octants=1, replicas=4, spread="node")
    h.deploy("soft", octants=1, replicas=4)
    await h.reconcile()
    by = {d: list(h.replicas(d)) for d in ("per-rack", "per-node", "soft")}
    placed = [r for r in by["per-rack"] if r.placed]
    assert sorted(h.nodes[int(r.node[1:])].labels["octacloud.io/rack"] for r in placed) == ["r1", "r2"]
    waiting = [r for r in by["per-rack"] if not r.placed]
    assert len(waiting) == 1 and waiting[0].state is ReplicaState.PENDING and "replica-spread" in waiting[0].message
    assert len({r.node for r in by["per-node"] if r.placed}) == 3 == sum(r.placed for r in by["per-node"])
    soft = [r.node for r in by["soft"]]
    assert all(soft) and set(soft) == {"n0", "n1", "n2"}  # four replicas on three nodes: all placed, all used


async def test_another_tenants_replicas_do_not_count(tmp_path: Path) -> None:
    h = Harness(tmp_path, fleet(2, cards=1), policy="octacloud")
    h.deploy("a", octants=1, replicas=2, spread="node", tenant="acme")
    h.deploy("b", octants=1, replicas=2, spread="node", tenant="umbrella")
    await h.reconcile()
    for d in ("a", "b"):
        assert sorted(r.node for r in h.replicas(d)) == ["n0", "n1"], d


def test_a_malformed_spread_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidSpecError, match=r"deployment 'x': spread must be one of \['soft', 'node', 'rack'\]"):
        DeploymentSpec("x", "m", spread="zone")
    with pytest.raises(InvalidSpecError, match="spread must be one of"):
        DeploymentSpec("x", "m", spread=["node"])  # type: ignore[arg-type]


async def test_a_restart_in_the_middle_keeps_the_spread(tmp_path: Path) -> None:
    h = Harness(tmp_path, fleet(3, cards=1), policy="octacloud")
    h.controller.deploy(DeploymentSpec("a", "m", octants=1, min_replicas=2, max_replicas=3, spread="node"))
    await h.reconcile()
    await h.health()
    first = {r.id: r.node for r in h.replicas("a")}
    h.controller = h.make()  # as after kill -9: a new controller over the same store and fleet
    h.controller.adopt()
    h.controller.scale("a", 3)
    await h.reconcile()
    nodes = {r.id: r.node for r in h.replicas("a")}
    assert {k: nodes[k] for k in first} == first  # nothing already placed moved
    assert sorted(nodes.values()) == ["n0", "n1", "n2"]
    assert h.store.get_deployment("a").spec.spread == "node"
