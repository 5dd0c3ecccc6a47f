"""A tenant cannot raise its own priority, deploy paths outside the repository, or read another's events.

The cloud runs with a launcher that starts nothing (replicas are placed and stay starting): these tests are
about the admin API and the scheduler's decisions, not about serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from octacloud.app import Cloud
from octacloud.control.launcher import Launched, LaunchSpec, ReplicaAddress
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import FLEET, CloudThread, config, wait_until

from .conftest import call, make_tenant


class PlacingOnly:
    """A launcher whose replicas exist but never become ready."""

    def launch(self, spec: LaunchSpec) -> Launched:
        return Launched(f"none:{spec.replica_id}", None)

    def address(self, handle: str) -> ReplicaAddress | None:
        return None

    def alive(self, handle: str) -> bool:
        return True

    def stop(self, handle: str, grace: float = 5.0) -> None:
        return None

    def handles(self) -> None:
        return None


class PlacingCloud(CloudThread):
    async def _make(self, cfg: Any) -> Cloud:
        return Cloud(cfg, nodes=FLEET, launcher=PlacingOnly())


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[CloudThread]:
    repo = tmp_path / "models"
    write_linear_model(repo)
    (tmp_path / "outside" / "linear" / "1").mkdir(parents=True)
    c = PlacingCloud(config(tmp_path, repo))
    yield c
    c.stop(stop_replicas=True)


def deploy(c: CloudThread, key: str | None, **body: Any) -> Any:
    return call(c, key, "POST", "/admin/deployments", {"model": "linear", **body})


def spec(c: CloudThread, name: str) -> dict[str, Any]:
    data: dict[str, Any] = c.deployment(name)["spec"]
    return data


def test_a_tenant_gets_its_priority_only_from_classes_granted_to_it(cloud: CloudThread) -> None:
    a = make_tenant(cloud, "a")
    b = make_tenant(cloud, "b")
    raw = deploy(cloud, a, name="greedy", octants=8, priority=1000)
    assert raw.status_code == 403 and "priority_class" in raw.json()["error"], raw.text
    assert call(cloud, cloud.key, "GET", "/admin/deployments/greedy").status_code == 404

    for body in ({"name": "prod", "priority": 100}, {"name": "batch", "priority": 1, "global_default": True}):
        assert call(cloud, cloud.key, "POST", "/admin/priority-classes", body).status_code == 201
    assert call(cloud, a, "POST", "/admin/priority-classes", {"name": "x", "priority": 9}).status_code == 403
    assert call(cloud, a, "POST", "/admin/tenants/a/priority-classes", {"class": "prod"}).status_code == 403
    grant = call(cloud, cloud.key, "POST", "/admin/tenants/a/priority-classes", {"class": "prod", "default": True})
    assert grant.status_code == 201, grant.text

    # b was granted nothing: "prod" and a class that does not exist are refused alike
    refused = [deploy(cloud, b, name=f"b{i}", priority_class=c) for i, c in enumerate(("prod", "nosuch"))]
    assert [r.status_code for r in refused] == [403, 403]
    assert all("not granted to tenant 'b'" in r.json()["error"] for r in refused)
    assert deploy(cloud, b, name="b-lin").status_code == 201
    assert (spec(cloud, "b-lin")["priority_class"], spec(cloud, "b-lin")["priority"]) == ("batch", 1)

    assert deploy(cloud, a, name="a-lin").status_code == 201  # its default class
    assert (spec(cloud, "a-lin")["priority_class"], spec(cloud, "a-lin")["priority"]) == ("prod", 100)
    assert deploy(cloud, a, name="a-batch", priority_class="batch").status_code == 201  # the cloud's default
    assert spec(cloud, "a-batch")["priority"] == 1

    # an admin may name any class or give a raw priority
    assert deploy(cloud, cloud.key, name="adm", priority_class="prod").status_code == 201
    assert spec(cloud, "adm")["priority"] == 100
    assert deploy(cloud, cloud.key, name="adm-raw", priority=7).status_code == 201
    assert spec(cloud, "adm-raw")["priority"] == 7

    # a tenant lists only what it may use
    mine = call(cloud, b, "GET", "/admin/priority-classes").json()
    assert [c["name"] for c in mine["classes"]] == ["batch"] and mine["grants"] == []


def test_a_tenant_without_a_granted_class_preempts_nobody(cloud: CloudThread) -> None:
    """The issue's attack: a tenant's 8-octant deployment at priority 1000 preempted the admin's and another
    tenant's replicas. Now its priority is its class's, and it waits instead."""
    call(cloud, cloud.key, "POST", "/admin/priority-classes", {"name": "prod", "priority": 100})
    a = make_tenant(cloud, "a")
    b = make_tenant(cloud, "b")
    assert deploy(cloud, cloud.key, name="adm", octants=6, priority_class="prod").status_code == 201
    assert deploy(cloud, b, name="b-lin", octants=6).status_code == 201
    wait_until("both placed", lambda: all(spec_placed(cloud, n) for n in ("adm", "b-lin")), timeout=30)
    assert deploy(cloud, a, name="greedy", octants=8, priority=1000).status_code == 403
    assert deploy(cloud, a, name="greedy", octants=8).status_code == 201
    wait_until("greedy considered", lambda: any(e["subject"].startswith("greedy") for e in events(cloud, cloud.key)))
    import time

    time.sleep(2.0)  # a few reconcile passes
    assert not [e for e in events(cloud, cloud.key) if e["kind"] == "preempted"]
    assert spec_placed(cloud, "adm") and spec_placed(cloud, "b-lin") and not spec_placed(cloud, "greedy")


def spec_placed(c: CloudThread, name: str) -> bool:
    return all(r["node"] for r in c.deployment(name)["instances"]) and bool(c.deployment(name)["instances"])


def events(c: CloudThread, key: str | None) -> list[dict[str, Any]]:
    response = call(c, key, "GET", "/admin/events?limit=1000")
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["events"]
    return found


@pytest.mark.parametrize(
    "model", ["../outside/linear", "/etc", "/", "/nonexistent-path", "linear/..", "./linear", "nosuch", "lin\\ear"]
)
def test_deploy_names_models_of_the_repository_only(cloud: CloudThread, model: str) -> None:
    a = make_tenant(cloud, "a")
    for key in (a, cloud.key):
        r = deploy(cloud, key, name="x", model=model)
        error = r.json()["error"]
        assert r.status_code == 404 and error.startswith(f"model {model!r} is not in the repository"), r.text
        assert error.endswith("(`octacloud models list` shows the models it holds)")
    assert call(cloud, cloud.key, "GET", "/admin/deployments/x").status_code == 404


def test_a_tenant_reads_only_its_own_events_when_names_share_a_prefix(cloud: CloudThread) -> None:
    a = make_tenant(cloud, "a")
    b = make_tenant(cloud, "b")
    assert deploy(cloud, a, name="lin").status_code == 201
    assert deploy(cloud, b, name="lin-abcdef").status_code == 201  # looks like one of a's replica ids
    wait_until("both placed", lambda: spec_placed(cloud, "lin") and spec_placed(cloud, "lin-abcdef"), timeout=30)
    b_replica = cloud.deployment("lin-abcdef")["instances"][0]["id"]
    a_replica = cloud.deployment("lin")["instances"][0]["id"]
    seen_a = {e["subject"] for e in events(cloud, a)}
    seen_b = {e["subject"] for e in events(cloud, b)}
    assert {"lin", a_replica} <= seen_a and not seen_a & {"lin-abcdef", b_replica}
    assert {"lin-abcdef", b_replica} <= seen_b and not seen_b & {"lin", a_replica}
    assert call(cloud, a, "DELETE", "/admin/deployments/lin").status_code == 200
    removed = [e for e in events(cloud, a) if e["kind"] == "undeploy"]
    assert [e["subject"] for e in removed] == ["lin"] and not [e for e in events(cloud, b) if e["kind"] == "undeploy"]


def test_admin_api_errors_come_from_one_table(cloud: CloudThread) -> None:
    a = make_tenant(cloud, "a")
    cases = [
        (None, "GET", "/admin/deployments", None, 401),
        (a, "GET", "/admin/fleet", None, 403),
        (a, "POST", "/admin/tenants", {"name": "z"}, 403),
        (a, "POST", "/admin/deployments", [1], 400),
        (a, "POST", "/admin/deployments", {"name": "Bad Name", "model": "linear"}, 400),
        (a, "POST", "/admin/deployments", {"name": "n", "model": "linear", "bogus": 1}, 400),
        (a, "GET", "/admin/deployments/nope", None, 404),
        (a, "POST", "/admin/deployments/nope/scale", {"replicas": 1}, 404),
        (cloud.key, "POST", "/admin/tenants/nope/quota", {"octants": 1}, 404),
        (cloud.key, "POST", "/admin/tenants/a/quota", {"octants": "x"}, 400),
        (cloud.key, "GET", "/admin/usage?by=nope", None, 400),
        (cloud.key, "POST", "/admin/priority-classes", {"name": "p", "priority": 1.5}, 400),
        (cloud.key, "DELETE", "/admin/priority-classes/nope", None, 404),
        (cloud.key, "POST", "/admin/priority-classes", {"name": "p", "priority": 1, "global_default": "no"}, 400),
        (cloud.key, "POST", "/admin/tenants/a/priority-classes", {"class": "nope"}, 404),
        (cloud.key, "POST", "/admin/tenants/nope/priority-classes", {"class": "p"}, 404),
    ]
    for key, method, path, body, status in cases:
        r = call(cloud, key, method, path, body)  # type: ignore[arg-type]
        assert r.status_code == status, (method, path, r.text)
        assert isinstance(r.json()["error"], str)
    assert deploy(cloud, a, name="lin").status_code == 201
    b = make_tenant(cloud, "b")
    assert deploy(cloud, b, name="lin").status_code == 409


def test_the_cli_defines_grants_and_deploys_with_priority_classes(cloud: CloudThread) -> None:
    from typer.testing import CliRunner

    from octacloud.cli.main import app

    runner = CliRunner()
    a = make_tenant(cloud, "a")

    def run(key: str, *args: str) -> str:
        result = runner.invoke(app, [*args, "--url", cloud.url, "--key", key])
        assert result.exit_code == 0, result.output
        return result.output

    run(cloud.key, "priority-class", "define", "prod", "--priority", "100", "--description", "customer-facing")
    run(cloud.key, "priority-class", "define", "batch", "--priority", "1", "--global-default")
    run(cloud.key, "tenant", "grant", "a", "prod", "--default")
    listed = run(cloud.key, "priority-class", "list")
    assert "prod" in listed and "a (default)" in listed and "every tenant" in listed
    run(a, "deploy", "linear", "--name", "a-lin")
    assert (spec(cloud, "a-lin")["priority_class"], spec(cloud, "a-lin")["priority"]) == ("prod", 100)
    refused = runner.invoke(
        app, ["deploy", "linear", "--name", "a-x", "--priority", "5", "--url", cloud.url, "--key", a]
    )
    assert refused.exit_code != 0 and "priority_class" in refused.output
    run(cloud.key, "tenant", "revoke", "a", "prod")
    run(a, "deploy", "linear", "--name", "a-next")
    assert spec(cloud, "a-next")["priority_class"] == "batch" and spec(cloud, "a-lin")["priority"] == 100
    run(cloud.key, "priority-class", "delete", "prod")
    assert "prod" not in run(cloud.key, "priority-class", "list")
