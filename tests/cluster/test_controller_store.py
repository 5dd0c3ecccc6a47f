"""The controller's store: reads from memory that match the database's, writes stored behind in order."""

from __future__ import annotations

from threading import Event

import pytest
from sqlalchemy.exc import OperationalError

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore
from octacloud.control.transitions import Transition


def test_reads_are_copies_and_match_what_is_stored(store_url: str) -> None:
    backing = StateStore(store_url)
    s = ControllerStore(backing)
    s.put_deployment(Deployment(DeploymentSpec("a", "m", tenant="acme"), 1, 2, 0.0))
    assert s.add_revision(s.get_deployment("a"), 1.0) == 1 and s.add_revision(s.get_deployment("a"), 2.0) == 2
    s.put_replica(Replica("a-1", "a", node="n0", gpus=(0,), milli_per_gpu=250, after=["x"]))
    s.begin_replacement(Replica("a-2", "a", replaces="a-1"), Transition("a-2", "a-1", "update", "a"))
    got = s.replicas("a")[0]
    got.state, got.after = ReplicaState.READY, []  # a caller's change is not the store's until it is put
    assert s.replicas("a")[0].state is ReplicaState.PENDING and s.replicas("a")[0].after == ["x"]
    s.add_event("ready", "a-1", "serving")
    assert s.flush(5)  # (rows from two writers are ordered as they reach the database)
    backing.add_event("node", "n0", "joined")  # written by someone else, straight to the database
    s.delete_replica("a-2")
    s.delete_transition("a-2")
    assert s.flush(5)
    assert backing.replicas() == s.replicas() and backing.transitions() == s.transitions() == []
    assert backing.deployments() == s.deployments() and backing.revisions("a") == s.revisions("a")
    assert [e["kind"] for e in s.events()] == ["node", "ready"] == [e["kind"] for e in backing.events()]
    assert s.events(tenant="acme")[0]["deployment"] == "a"  # stamped from memory as the database would
    s.close()
    again = ControllerStore(backing)  # a restart reads what was stored
    assert again.replicas() == backing.replicas() and again.events(10) == backing.events(10)
    again.close()
    backing.close()


def queued_behind_a_gate(backing: StateStore, monkeypatch: pytest.MonkeyPatch) -> tuple[ControllerStore, Event]:
    """A controller store whose first write (the deployment) waits for the returned gate, so that what is queued
    meanwhile reaches the store thread together, as a fleet's deploy does."""
    gate, put = Event(), backing.put_deployment

    def held(d: Deployment) -> None:
        assert gate.wait(30)
        put(d)

    monkeypatch.setattr(backing, "put_deployment", held)
    s = ControllerStore(backing)
    s.put_deployment(Deployment(DeploymentSpec("a", "m", tenant="acme"), 5, 2, 0.0))
    for k in range(1, 6):
        s.put_replica(Replica(f"a-{k}", "a"))
    s.add_event("placed", "a-1", "n0")
    return s, gate


def test_a_write_that_can_never_succeed_is_dropped_alone_and_the_rest_of_its_batch_stored_once(
    store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backing = StateStore(store_url)
    put, batches = backing.put_replica, []

    def put_replica(r: Replica) -> None:
        if r.id == "a-3":
            raise ValueError("cannot be stored")
        put(r)

    monkeypatch.setattr(backing, "put_replica", put_replica)
    batch = backing.batch
    monkeypatch.setattr(backing, "batch", lambda: batches.append(1) or batch())
    s, gate = queued_behind_a_gate(backing, monkeypatch)
    gate.set()
    assert s.flush(30)
    assert batches, "the queued writes were never stored together"
    assert [r.id for r in backing.replicas()] == ["a-1", "a-2", "a-4", "a-5"]
    assert [e["kind"] for e in backing.events()] == ["placed"]  # the failed batch was rolled back: stored once
    assert "dropped" in caplog.text and [r.id for r in s.replicas()] == ["a-1", "a-2", "a-3", "a-4", "a-5"]
    s.put_replica(Replica("a-6", "a"))  # and the thread goes on batching
    assert s.flush(30) and backing.replicas()[-1].id == "a-6"
    s.close()
    backing.close()


def test_a_batch_that_meets_a_locked_database_is_stored_whole_once_it_is_free(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backing = StateStore(store_url)
    put, locked = backing.put_replica, [True]

    def put_replica(r: Replica) -> None:
        if r.id == "a-4" and locked:
            locked.clear()
            raise OperationalError("UPDATE replicas", {}, Exception("database is locked"))
        put(r)

    monkeypatch.setattr(backing, "put_replica", put_replica)
    s, gate = queued_behind_a_gate(backing, monkeypatch)
    gate.set()
    assert s.flush(30) and not locked and s.failing is None
    assert [r.id for r in backing.replicas()] == [f"a-{k}" for k in range(1, 6)]
    assert [e["kind"] for e in backing.events()] == ["placed"] and backing.get_deployment("a").replicas == 5
    s.close()
    backing.close()
