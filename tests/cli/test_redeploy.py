"""``octacloud deploy`` against a real cloud, as the README uses it: a model deployed with the defaults may be
scaled to 2, and re-running ``deploy`` with another model rolls it out on the 2 replicas the operator set,
saying what it kept; ``up --deploy`` gets the same defaults and the same quota checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.cli.up import _deploy_once
from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until
from tests.security.conftest import call, make_tenant

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    root = tmp_path_factory.mktemp("redeploy")
    write_linear_model(root / "models")
    write_linear_model(root / "models", "linear2")
    c = CloudThread(config(root, root / "models"))
    yield c
    c.stop(stop_replicas=True)


def cli(c: CloudThread, *args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--url", c.url, "--key", c.key])
    assert result.exit_code == 0, result.output
    return result.output


def serving(c: CloudThread, name: str, model: str, n: int) -> bool:
    """``n`` ready replicas of ``name``, every one of them on ``model`` (a rolling update done)."""
    replicas = c.deployment(name)["instances"]
    rollout = c.admin("GET", f"/deployments/{name}/rollout").json()
    return len(ready_ids(c, name)) == n == len(replicas) and rollout["complete"] and rollout["model"] == model


def test_a_redeploy_keeps_the_replicas_the_operator_scaled_to(cloud: CloudThread) -> None:
    out = cli(cloud, "deploy", "linear", "--name", "lin")
    assert "deployed lin: 1 replica(s)" in out, out
    spec: dict[str, Any] = cloud.deployment("lin")["spec"]
    assert (spec["octants"], spec["min_replicas"], spec["max_replicas"]) == (None, 1, DEFAULT_MAX_REPLICAS)

    assert "lin: 2 replica(s)" in cli(cloud, "scale", "lin", "2")  # the README's next step
    wait_until("2 replicas of linear", lambda: serving(cloud, "lin", "linear", 2))

    out = cli(cloud, "deploy", "linear2", "--name", "lin")
    assert "deployed lin: 2 replica(s)" in out, out
    assert "keeps " in out and "2 replica(s)" in out and "max_replicas 4" in out and "octants auto" in out, out
    assert "changes model linear → linear2" in out, out
    wait_until("2 replicas of linear2", lambda: serving(cloud, "lin", "linear2", 2))
    d = cloud.deployment("lin")
    assert d["replicas"] == 2 and d["spec"]["max_replicas"] == DEFAULT_MAX_REPLICAS
    events = cloud.admin("GET", "/events?limit=500").json()["events"]
    [update] = [e for e in events if e["kind"] == "deploy" and "rolling update" in e["message"]]
    assert "rolling update of 2 replica(s) from linear latest" in update["message"], update

    # what the command names changes, and only that
    out = cli(cloud, "deploy", "linear2", "--name", "lin", "--max-replicas", "3")
    assert "changes max_replicas 4 → 3" in out and "2 replica(s)" in out, out
    assert cloud.deployment("lin")["replicas"] == 2

    # a malformed redeploy changes nothing, and another tenant cannot take the name over
    bad = call(cloud, cloud.key, "POST", "/admin/deployments", {"name": "lin", "min_replicas": 1.5})
    assert bad.status_code == 400 and "min_replicas must be a whole number" in bad.json()["error"], bad.text
    other = make_tenant(cloud, "other")
    taken = call(cloud, other, "POST", "/admin/deployments", {"name": "lin", "model": "linear"})
    assert taken.status_code == 409 and "'lin' is taken" in taken.json()["error"], taken.text
    d = cloud.deployment("lin")
    assert (d["replicas"], d["spec"]["model"], d["spec"]["max_replicas"]) == (2, "linear2", 3)

    # an admin's redeploy of a tenant's deployment keeps its owner (it answered 409 "taken" without --tenant)
    assert call(cloud, other, "POST", "/admin/deployments", {"name": "theirs", "model": "linear"}).status_code == 201
    out = cli(cloud, "deploy", "linear2", "--name", "theirs")
    assert "changes model linear → linear2" in out and cloud.deployment("theirs")["spec"]["tenant"] == "other", out
    assert call(cloud, other, "GET", "/admin/deployments/theirs").status_code == 200


def test_up_deploy_takes_the_same_defaults_and_checks(cloud: CloudThread) -> None:
    _deploy_once(cloud.cloud, "linear", DEFAULT_MAX_REPLICAS)
    spec = cloud.deployment("linear")["spec"]
    assert (spec["octants"], spec["min_replicas"], spec["max_replicas"], spec["tenant"]) == (None, 1, 4, "admin")
    # the admin tenant's quota holds for up --deploy as for the API (it bypassed the check before)
    assert cloud.admin("POST", "/tenants/admin/quota", {"octants": 1}).status_code == 200
    try:
        _deploy_once(cloud.cloud, "linear2", DEFAULT_MAX_REPLICAS)
        assert cloud.admin("GET", "/deployments/linear2").status_code == 404
    finally:
        assert cloud.admin("POST", "/tenants/admin/quota", {"octants": None}).status_code == 200
