"""The state store keeps deployments, replicas and events across restarts."""

from __future__ import annotations

import pytest

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore
from octacloud.control.transitions import Transition
from octacloud.core import InvalidSpecError, NotFoundError


def test_round_trip_survives_reopen(store_url: str) -> None:
    store = StateStore(store_url)
    spec = DeploymentSpec(name="mlp", model="mlp", octants=2, min_replicas=1, max_replicas=3, priority=5)
    store.put_deployment(Deployment(spec, replicas=2, octants=2, created_at=1.0))
    store.put_replica(Replica("mlp-1", "mlp", "n0", (0,), 250, ReplicaState.READY, pid=42, http_port=9000))
    store.add_event("placed", "mlp-1", "n0/gpu0")
    store.close()

    again = StateStore(store_url)
    (d,) = again.deployments()
    assert d.spec == spec and d.replicas == 2
    (r,) = again.replicas("mlp")
    assert r.gpus == (0,) and r.state is ReplicaState.READY and r.pid == 42
    assert again.events()[0]["subject"] == "mlp-1"
    again.delete_replica("mlp-1")
    again.delete_deployment("mlp")
    assert again.deployments() == [] and again.replicas() == []
    with pytest.raises(NotFoundError, match="no deployment named 'mlp'"):
        again.get_deployment("mlp")
    again.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Bad Name", "model": "m"}, "must be 1-63 lowercase"),
        ({"name": "d", "model": ""}, "model must not be empty"),
        ({"name": "d", "model": "m", "octants": 0}, "octants must be >= 1"),
        ({"name": "d", "model": "m", "octants": 12}, "multiple of 8 octants"),
        ({"name": "d", "model": "m", "min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
        ({"name": "d", "model": "m", "target_qps": 0}, "target_qps must be > 0"),
    ],
)
def test_bad_deployments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        DeploymentSpec(**kwargs)  # type: ignore[arg-type]


def test_replacements_revisions_and_events_round_trip(store_url: str) -> None:
    store = StateStore(store_url)
    spec = DeploymentSpec(name="mlp", model="mlp", octants=2, tenant="acme")
    d = Deployment(spec, replicas=1, octants=2, created_at=1.0)
    store.put_deployment(d)
    assert store.add_revision(d, 1.0) == 1 and store.add_revision(d, 2.0) == 2
    store.put_replica(Replica("mlp-1", "mlp", "n0", (0, 1), 1000, ReplicaState.READY))
    store.begin_replacement(
        Replica("mlp-2", "mlp", "n1", (3,), 250, replaces="mlp-1"),
        Transition("mlp-2", "mlp-1", "move", "mlp", "starting", "n1", (3,), 250),
    )
    store.put_transition(Transition("mlp-2", "mlp-1", "move", "mlp", "routing", "n1", (3,), 250))
    store.add_event("placed", "mlp-2", "n1 cards [3]")  # stamped with the replica's deployment and tenant
    store.add_event("node", "mlp-1", "a node named like a replica")  # a fleet event: no tenant
    store.close()

    again = StateStore(store_url)
    (t,) = again.transitions()
    assert (t.phase, t.node, t.gpus, t.milli_per_gpu) == ("routing", "n1", (3,), 250)
    assert [r.id for r in again.replicas("mlp")] == ["mlp-1", "mlp-2"] and again.replicas("mlp")[0].gpus == (0, 1)
    assert [(n, o) for n, _, o, _ in again.revisions("mlp")] == [(1, 2), (2, 2)]
    assert [e["kind"] for e in again.events(tenant="acme")] == ["placed"]
    assert [e["kind"] for e in again.events()] == ["node", "placed"]
    again.delete_transition("mlp-2")
    again.delete_revisions("mlp")
    again.delete_deployment("mlp")
    again.add_event("undeploy", "mlp", "removed")  # the removed deployment's tenant still stamps its events
    assert again.transitions() == [] and again.revisions("mlp") == []
    assert again.events(1, tenant="acme")[0]["kind"] == "undeploy"
    again.close()


def test_a_fleet_of_replicas_round_trips(store_url: str) -> None:
    """A thousand-card fleet's replicas (four deployments of 250), written behind by the controller's store, read
    back after a restart."""
    backing = StateStore(store_url)
    store = ControllerStore(backing)
    for d in range(4):
        store.put_deployment(Deployment(DeploymentSpec(name=f"mlp-{d}", model="mlp"), 250, 2, float(d)))
    for k in range(1000):
        node, card = divmod(k, 8)
        store.put_replica(Replica(f"mlp-{k:04d}", f"mlp-{k // 250}", f"n{node:03d}", (card,), 250, ReplicaState.READY,
                                  http_port=10_000 + k, handle=f"emu:h0:mlp-{k:04d}"))  # fmt: skip
    assert store.flush(300)
    store.close()
    backing.close()
    again = StateStore(store_url)
    replicas = again.replicas()
    assert len(replicas) == 1000 and replicas[123].http_port == 10_123 and replicas[123].node == "n015"
    assert [len(again.replicas(f"mlp-{d}")) for d in range(4)] == [250] * 4
    assert ControllerStore(again).replicas() == replicas
    again.close()
