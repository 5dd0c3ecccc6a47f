"""One bad record never stops the cloud: a stored record that fails its checks (written by an older octacloud, or
by hand) is set aside with a ``quarantine`` event while the rest is loaded and scheduled, and a deployment whose
reconciliation raises is left out of the pass while the others are placed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import Deployment, DeploymentSpec, ReplicaState
from octacloud.control.sizing import ModelFootprint
from octacloud.control.store import StateStore, Store
from octacloud.core.errors import ConflictError, NotFoundError

from .controller_fakes import Harness

BAD_SPEC = {"name": "bad", "model": "m", "version": "", "octants": 1, "min_replicas": 1.5, "max_replicas": 2,
            "target_qps": None, "slo_ms": None, "priority": 0, "priority_class": "", "tenant": "acme",
            "published": False}  # fmt: skip
"""What a tenant's ``min_replicas: 1.5`` was stored as before fields were checked."""


def write_bad_rows(backing: StateStore, *, replica_of: str = "") -> None:
    """Rows an older octacloud (or a hand) left: a deployment with a fractional bound, a replica of ``replica_of``
    whose record is not even JSON, and a revision of the bad deployment."""
    with backing.engine.begin() as c:
        insert = "INSERT INTO deployments (name, spec, replicas, octants, created_at, generation) VALUES "
        c.execute(text(insert + "('bad', :spec, 1, 1, 5.0, 1)"), {"spec": json.dumps(BAD_SPEC)})
        c.execute(
            text("INSERT INTO revisions (deployment, revision, spec, octants, at) VALUES ('bad', 1, :spec, 1, 5.0)"),
            {"spec": json.dumps(BAD_SPEC)},
        )
        if replica_of:
            c.execute(
                text("INSERT INTO replicas (id, deployment, data) VALUES (:id, :d, '{not json')"),
                {"id": f"{replica_of}-zz", "d": replica_of},
            )


def rows(backing: StateStore, table: str) -> int:
    with backing.engine.connect() as c:
        return int(c.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


@pytest.fixture(params=["database", "controller"])
def opened(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, StateStore]]:
    backing = StateStore.at(tmp_path / "s.db")
    backing.put_deployment(Deployment(DeploymentSpec("good", "m", tenant="acme"), 1, 2, created_at=1.0))
    write_bad_rows(backing)
    if request.param == "database":
        yield backing, backing
    else:
        s = ControllerStore(StateStore.at(tmp_path / "s.db"))
        yield s, backing
        s.close()
    backing.close()


def test_reads_skip_an_unreadable_record_and_list_it(opened: tuple[Store, StateStore]) -> None:
    store, _ = opened
    assert [d.spec.name for d in store.deployments()] == ["good"]
    assert store.revisions("bad") == []
    [u] = [u for u in store.unreadable() if u.kind == "deployment"]
    assert (u.key, u.tenant) == ("bad", "acme") and "min_replicas must be a whole number" in u.reason
    with pytest.raises(NotFoundError, match="'bad' is set aside: stored deployment 'bad' cannot be read"):
        store.get_deployment("bad")
    # deploying the name again replaces the record; nothing else was lost meanwhile
    store.put_deployment(Deployment(DeploymentSpec("bad", "m", tenant="acme", min_replicas=1, max_replicas=2), 1, 1))
    assert store.get_deployment("bad").spec.min_replicas == 1
    assert not [u for u in store.unreadable() if u.kind == "deployment"]


def test_an_unreadable_deployment_can_be_deleted(opened: tuple[Store, StateStore]) -> None:
    store, backing = opened
    store.delete_deployment("bad")
    store.delete_revisions("bad")
    if isinstance(store, ControllerStore):
        store.flush()
    assert rows(backing, "deployments") == 1 and rows(backing, "revisions") == 0
    assert store.unreadable() == []


async def test_the_controller_starts_and_schedules_around_bad_records(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("good", octants=2)
    await h.reconcile()
    await h.health()
    [first] = h.ready("good")
    h.controller.store.close()
    write_bad_rows(h.backing, replica_of="good")

    h.controller = h.make()  # a restart over the bad rows (this raised InvalidSpecError, for every start)
    h.controller.adopt()
    events = {str(e["subject"]): str(e["message"]) for e in h.events("quarantine")}
    assert set(events) == {"bad", "bad revision 1", "good-zz"}, events
    assert "deploy 'bad' again (which replaces it) or undeploy it" in events["bad"]
    assert "it is dropped" in events["good-zz"]
    h.deploy("later", octants=2)
    await h.reconcile()
    await h.health()
    assert [r.id for r in h.ready("good")] == [first.id]  # adopted, not restarted
    assert len(h.ready("later")) == 1 and h.replicas("bad") == []
    h.controller.store.flush()
    assert rows(h.backing, "replicas") == 2  # the unreadable replica record is dropped; the deployment kept
    assert rows(h.backing, "deployments") == 3

    with pytest.raises(ConflictError, match="'bad' is taken"):  # the name stays its tenant's
        h.deploy("bad", octants=2, tenant="other")
    h.deploy("bad", octants=2, tenant="acme")  # its tenant deploys it again: it runs, no longer set aside
    await h.reconcile()
    await h.health()
    assert len(h.ready("bad")) == 1
    assert [n for n, *_ in h.store.revisions("bad")] == [2]  # numbered after the unreadable revision 1
    h.controller = h.make()
    assert [(u.kind, u.key) for u in h.store.unreadable()] == [("revision", "bad revision 1")]  # history, kept
    assert [n for n, *_ in h.store.revisions("bad")] == [2]


async def test_a_deployment_that_cannot_be_reconciled_is_left_out_and_the_rest_is_placed(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2)
    h.deploy("b", octants=2, model="m2")

    def footprint(model: str) -> ModelFootprint:
        if model == "m2":
            raise OSError("model store: connection reset")
        return ModelFootprint(1 << 20)

    h.footprint = footprint
    await h.reconcile()  # this raised OSError, and no deployment was placed
    await h.reconcile()
    await h.health()
    assert len(h.ready("a")) == 1
    assert [r.state for r in h.replicas("b")] == [ReplicaState.PENDING]
    [event] = h.events("quarantine")  # once, not every pass
    assert event["subject"] == "b" and "OSError: model store: connection reset" in str(event["message"])

    h.footprint = lambda model: ModelFootprint(1 << 20)  # the store is back
    await h.reconcile()
    await h.health()
    assert len(h.ready("b")) == 1 and len(h.ready("a")) == 1
