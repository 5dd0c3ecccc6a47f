"""The state store keeps deployments, replicas and events across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore
from octacloud.core import InvalidSpecError, NotFoundError


def test_round_trip_survives_reopen(tmp_path: Path) -> None:
    store = StateStore.at(tmp_path / "state.db")
    spec = DeploymentSpec(name="mlp", model="mlp", octants=2, min_replicas=1, max_replicas=3, priority=5)
    store.put_deployment(Deployment(spec, replicas=2, octants=2, created_at=1.0))
    store.put_replica(Replica("mlp-1", "mlp", "n0", (0,), 250, ReplicaState.READY, pid=42, http_port=9000))
    store.add_event("placed", "mlp-1", "n0/gpu0")
    store.close()

    again = StateStore.at(tmp_path / "state.db")
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
