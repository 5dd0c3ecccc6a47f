"""The :class:`Store` contract, checked the same way against both stores: the database (``StateStore``) and the
controller's copy in memory in front of it (``ControllerStore``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore, Store
from octacloud.control.transitions import Transition
from octacloud.core.errors import NotFoundError


@pytest.fixture(params=["database", "controller"])
def store(request: pytest.FixtureRequest, store_url: str) -> Iterator[Store]:
    """Each store over each database (``store_url``: SQLite, then a real PostgreSQL server)."""
    backing = StateStore(store_url)
    if request.param == "database":
        yield backing
    else:
        s = ControllerStore(backing)
        yield s
        s.close()
    backing.close()


def deployment(name: str, at: float, tenant: str = "default") -> Deployment:
    return Deployment(DeploymentSpec(name, "m", tenant=tenant), 1, 2, created_at=at)


def test_reads_are_copies(store: Store) -> None:
    store.put_deployment(deployment("a", 1.0))
    store.put_replica(Replica("a-1", "a", after=["x"]))
    got, d = store.replicas()[0], store.get_deployment("a")
    got.state, got.after, d.replicas = ReplicaState.READY, [], 7
    assert store.replicas()[0].state is ReplicaState.PENDING and store.replicas()[0].after == ["x"]
    assert store.get_deployment("a").replicas == 1


def test_keys_replace_and_missing_ones_say_so(store: Store) -> None:
    store.put_deployment(deployment("a", 1.0))
    store.put_deployment(Deployment(DeploymentSpec("a", "m"), 3, 2, created_at=1.0))
    assert [d.replicas for d in store.deployments()] == [3]
    with pytest.raises(NotFoundError, match="'nope'"):
        store.get_deployment("nope")
    with pytest.raises(NotFoundError, match="'nope'"):
        store.delete_deployment("nope")
    store.delete_replica("nope")  # nothing to do, nothing raised
    store.delete_transition("nope")
    assert store.transition("nope") is None


def test_order(store: Store) -> None:
    store.put_deployment(deployment("late", 2.0))
    store.put_deployment(deployment("early", 1.0))
    for rid in ("b-2", "a-1", "c-3"):
        store.put_replica(Replica(rid, "early"))
    store.add_event("k", "early", "first")
    store.add_event("k", "early", "second")
    assert [d.spec.name for d in store.deployments()] == ["early", "late"]
    assert [r.id for r in store.replicas()] == ["a-1", "b-2", "c-3"]
    assert [e["message"] for e in store.events()] == ["second", "first"]
    assert [store.add_revision(store.get_deployment("early"), at) for at in (1.0, 2.0)] == [1, 2]
    assert [n for n, *_ in store.revisions("early")] == [1, 2]


def test_a_replacement_lives_and_dies_with_its_surge_replica(store: Store) -> None:
    store.put_deployment(deployment("a", 1.0))
    store.put_replica(Replica("a-1", "a"))
    store.begin_replacement(Replica("a-2", "a", replaces="a-1"), Transition("a-2", "a-1", "update", "a"))
    assert [r.id for r in store.replicas()] == ["a-1", "a-2"]
    assert store.transition("a-2") == Transition("a-2", "a-1", "update", "a")
    store.put_transition(Transition("a-2", "a-1", "update", "a", "routing"))
    assert [t.phase for t in store.transitions()] == ["routing"]
    store.delete_replica("a-1")  # the source going does not end the replacement
    assert store.transition("a-2") is not None
    store.delete_replica("a-2")  # its surge replica going does
    assert store.transition("a-2") is None and store.transitions() == []


def test_events_are_stamped_with_their_owner_and_heard_by_subscribers(store: Store) -> None:
    heard: list[dict[str, object]] = []
    store.subscribe(heard.append)
    store.put_deployment(deployment("a", 1.0, tenant="acme"))
    store.put_replica(Replica("a-1", "a"))
    store.add_event("ready", "a-1", "serving")
    store.add_event("node", "a", "a node named like a deployment")
    assert [(e["deployment"], e["tenant"]) for e in heard] == [("a", "acme"), ("", "")]
    assert [e["message"] for e in store.events(tenant="acme")] == ["serving"]


def test_a_deployments_replicas_are_its_own_in_id_order(store: Store) -> None:
    for name in ("a", "b"):
        store.put_deployment(deployment(name, 1.0))
    for rid in ("a-3", "b-1", "a-1", "a-2"):
        store.put_replica(Replica(rid, rid[0]))
    store.put_replica(Replica("a-1", "a", node="n0"))  # replaced, not added
    store.delete_replica("a-2")
    assert [r.id for r in store.replicas("a")] == ["a-1", "a-3"] and store.replicas("a")[0].node == "n0"
    assert [r.id for r in store.replicas("b")] == ["b-1"] and store.replicas("nope") == []
