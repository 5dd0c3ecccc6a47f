"""The controller's store: reads from memory that match the database's, writes stored behind in order."""

from __future__ import annotations

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore, Transition


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
