"""Admin and tenant input that used to get a 500 or stop the cloud: each gets a clear 400 naming the field,
nothing of it is saved, and the cloud keeps serving (its loop completes passes, readiness stays 200, the
tenants' inference works). Driven through the real gateway of one cloud for the module."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until

from .conftest import call, make_tenant
from .test_gateway_auth import infer_body

pytestmark = pytest.mark.slow


@dataclass
class Target:
    cloud: CloudThread
    key_a: str


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("admin-input")
    write_linear_model(root / "models")
    c = CloudThread(config(root, root / "models"))
    try:
        key_a = make_tenant(c, "a", octants=64, requests_per_s=100.0, burst=100)
        created = call(c, key_a, "POST", "/admin/deployments", {"name": "a-lin", "model": "linear", "octants": 1})
        assert created.status_code == 201, created.text
        wait_until("a-lin ready", lambda: bool(ready_ids(c, "a-lin")))
        yield Target(c, key_a)
    finally:
        c.stop(stop_replicas=True)


def raw(c: CloudThread, key: str, method: str, path: str, body: Any) -> httpx.Response:
    """Send ``body`` as JSON spelled the way Python's json writes it: NaN, Infinity and huge integers included."""
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.request(method, f"{c.url}{path}", content=content, headers=headers, timeout=60)


def passes(c: CloudThread) -> int:
    state = call(c, c.key, "GET", "/admin/controller").json()
    assert state["failed_iterations"] == 0 and state["ready"], state
    count: int = state["passes"]
    return count


def still_serving(t: Target) -> None:
    """The controller completes two more passes without a failure, readiness is 200, and inference works."""
    c = t.cloud
    before = passes(c)
    wait_until("two more controller passes", lambda: passes(c) >= before + 2)
    assert httpx.get(f"{c.url}/v2/health/ready", timeout=30).status_code == 200
    answer = call(c, t.key_a, "POST", "/v2/models/a-lin/infer", infer_body())
    assert answer.status_code == 200, answer.text


def names(c: CloudThread) -> list[str]:
    return sorted(d["spec"]["name"] for d in call(c, c.key, "GET", "/admin/deployments").json()["deployments"])


# ---- #33 item 3: a fractional replica count stopped every controller pass ----------------------------------


def test_fractional_min_replicas_is_refused_and_the_cloud_keeps_serving(target: Target) -> None:
    c = target.cloud
    body = {"name": "x", "model": "linear", "min_replicas": 1.5, "max_replicas": 2}
    refused = raw(c, target.key_a, "POST", "/admin/deployments", body)
    assert refused.status_code == 400, refused.text
    assert "min_replicas must be a whole number in 0..256, got 1.5" in refused.json()["error"]
    assert call(c, c.key, "GET", "/admin/deployments/x").status_code == 404  # nothing saved
    still_serving(target)


BAD_DEPLOYMENTS = [
    ({"octants": 1.5}, "octants must be a whole number"),
    ({"octants": True}, "octants must be a whole number in 1..512, got true"),
    ({"octants": 10**30}, "octants must be a whole number in 1..512, got a 31-digit number"),
    ({"octants": "2"}, "octants must be a whole number"),
    ({"max_replicas": 2.0}, "max_replicas must be a whole number"),
    ({"max_replicas": 10**30}, "max_replicas must be a whole number"),
    ({"min_replicas": False}, "min_replicas must be a whole number"),
    ({"version": "²"}, "version '²' must be a version number"),
    ({"version": 1}, "version 1 must be a version number"),
    ({"version": -1}, "version -1 must be a version number"),
    ({"version": "1\n"}, "version '1\\n' must be a version number"),
    ({"octants": None, "target_qps": math.inf}, "target_qps must be > 0, finite and <= 1e+09, got Infinity"),
    ({"octants": None, "target_qps": math.nan}, "target_qps must be > 0, finite and <= 1e+09, got NaN"),
    ({"target_qps": True}, "target_qps must be > 0"),
    ({"slo_ms": -math.inf}, "slo_ms must be > 0"),
    ({"published": 1}, "published must be true or false, got 1"),
    ({"name": "b\n"}, "deployment name 'b\\n' must be 1-63 lowercase"),
    ({"name": "b\x00"}, "deployment name 'b\\x00' must be 1-63 lowercase"),
    ({"name": 7}, "deployment name 7 must be 1-63 lowercase"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_DEPLOYMENTS, ids=[repr(f) for f, _ in BAD_DEPLOYMENTS])
def test_deployment_fields_are_checked_by_type_and_range(target: Target, fields: dict[str, Any], message: str) -> None:
    c = target.cloud
    before = names(c)
    refused = raw(c, target.key_a, "POST", "/admin/deployments", {"name": "x", "model": "linear", **fields})
    assert refused.status_code == 400, refused.text
    assert message in refused.json()["error"]
    assert names(c) == before


def test_scale_takes_a_whole_replica_count(target: Target) -> None:
    c = target.cloud
    for replicas in (1.5, True, 10**30, -1, "1", None):
        refused = raw(c, target.key_a, "POST", "/admin/deployments/a-lin/scale", {"replicas": replicas})
        assert refused.status_code == 400 and "replicas" in refused.json()["error"], refused.text
    assert call(c, target.key_a, "GET", "/admin/deployments/a-lin").json()["replicas"] == 1
    still_serving(target)


# ---- #33 item 7: tenants, quotas, classes, keys and queries ----------------------------------------------


def quota(c: CloudThread, tenant: str) -> dict[str, Any]:
    [found] = [t for t in call(c, c.key, "GET", "/admin/tenants").json()["tenants"] if t["name"] == tenant]
    q: dict[str, Any] = found["quota"]
    return q


BAD_QUOTAS = [
    ({"requests_per_s": math.nan}, "requests_per_s must be > 0, finite and <= 1e+06, got NaN"),
    ({"requests_per_s": math.inf}, "requests_per_s must be > 0"),
    ({"requests_per_s": True}, "requests_per_s must be > 0"),
    ({"burst": 10**30}, "burst must be a whole number in 1..1000000, got a 31-digit number"),
    ({"burst": 0}, "burst must be a whole number in 1..1000000, got 0"),
    ({"burst": 2.5}, "burst must be a whole number"),
    ({"tokens_per_minute": 0}, "tokens_per_minute must be a whole number in 1.."),
    ({"tokens_per_minute": "lots"}, "tokens_per_minute must be a whole number"),
    ({"max_streams": -1}, "max_streams must be a whole number in 0.."),
    ({"max_streams": 1.5}, "max_streams must be a whole number"),
    ({"octants": 10**30}, "octants must be a whole number in 0..1000000"),
    ({"deployments": 1.5}, "deployments must be a whole number"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_QUOTAS, ids=[repr(f) for f, _ in BAD_QUOTAS])
def test_quota_fields_are_checked_by_type_and_range(target: Target, fields: dict[str, Any], message: str) -> None:
    c = target.cloud
    created = raw(c, c.key, "POST", "/admin/tenants", {"name": "t-new", **fields})
    assert created.status_code == 400 and message in created.json()["error"], created.text
    assert "t-new" not in [t["name"] for t in call(c, c.key, "GET", "/admin/tenants").json()["tenants"]]
    before = quota(c, "a")
    changed = raw(c, c.key, "POST", "/admin/tenants/a/quota", fields)
    assert changed.status_code == 400 and message in changed.json()["error"], changed.text
    assert quota(c, "a") == before  # nothing saved: the limit still holds as it was


def test_a_rate_without_a_burst_gets_one_second_of_it(target: Target) -> None:
    c = target.cloud
    created = call(c, c.key, "POST", "/admin/tenants", {"name": "slow", "requests_per_s": 2})
    assert created.status_code == 201 and created.json()["quota"]["burst"] == 2, created.text
    changed = call(c, c.key, "POST", "/admin/tenants/slow/quota", {"requests_per_s": 0.5})
    assert changed.json()["quota"] == {"octants": None, "deployments": None, "requests_per_s": 0.5, "burst": 1,
                                       "tokens_per_minute": None, "max_streams": None}  # fmt: skip
    kept = call(c, c.key, "POST", "/admin/tenants/slow/quota", {"octants": 4})
    assert kept.json()["quota"]["burst"] == 1  # a change that names no rate keeps the burst
    explicit = call(c, c.key, "POST", "/admin/tenants/slow/quota", {"requests_per_s": 10, "burst": 3})
    assert explicit.json()["quota"]["burst"] == 3


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/admin/tenants", {"name": "t\n"}, "tenant name 't\\n' must be 1-32 lowercase"),
        ("/admin/tenants", {"name": "t\r"}, "tenant name 't\\r' must be 1-32 lowercase"),
        ("/admin/keys", {"tenant": "a\n"}, "tenant 'a\\n' must be 1-32 lowercase"),
        ("/admin/keys", {"tenant": "a", "note": "x\r\ny"}, "note must be text"),
        ("/admin/keys", {"tenant": "a", "role": ["admin"]}, "role must be admin or tenant"),
        ("/admin/priority-classes", {"name": "p\n", "priority": 1}, "priority class name 'p\\n' must be"),
        ("/admin/priority-classes", {"name": "p", "priority": 1.5}, "priority must be a whole number"),
        ("/admin/priority-classes", {"name": "p", "priority": 10**30}, "priority must be a whole number"),
        ("/admin/priority-classes", {"name": "p", "priority": 1, "description": "a\nb"}, "description must be"),
    ],
)
def test_names_and_text_match_in_full(target: Target, path: str, body: dict[str, Any], message: str) -> None:
    c = target.cloud
    refused = raw(c, c.key, "POST", path, body)
    assert refused.status_code == 400 and message in refused.json()["error"], refused.text
    assert [t["name"] for t in call(c, c.key, "GET", "/admin/tenants").json()["tenants"] if "\n" in t["name"]] == []
    assert call(c, c.key, "GET", "/admin/priority-classes").json()["classes"] == []


@pytest.mark.parametrize(
    "path",
    ["/admin/events?limit=1000000000000000000000000000000", "/admin/events?limit=-1", "/admin/events?limit=%C2%B2",
     "/admin/usage?from=inf", "/admin/usage?from=1e300", "/admin/usage?to=nan"],
)  # fmt: skip
def test_query_numbers_are_checked(target: Target, path: str) -> None:
    refused = call(target.cloud, target.key_a, "GET", path)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"].startswith(("limit must be", "from must be", "to must be"))


def test_json_nested_deeper_than_the_parser_goes_is_refused(target: Target) -> None:
    c = target.cloud
    deep = b"[" * 200_000 + b"]" * 200_000
    for path in ("/admin/deployments", "/admin/tenants", "/admin/tenants/a/quota", "/admin/deployments/a-lin/scale"):
        refused = raw(c, c.key, "POST", path, deep)
        assert refused.status_code == 400 and "must be a JSON object" in refused.json()["error"], refused.text
    still_serving(target)


# ---- what a tenant sees, and what a key without its scheme is told -------------------------------------------


def test_a_tenant_sees_its_replicas_state_but_not_their_addresses(target: Target) -> None:
    c = target.cloud
    internal = {"pid", "host", "handle", "http_port", "grpc_port", "metrics_port", "env"}
    for path in ("/admin/deployments/a-lin", "/admin/deployments"):
        body = call(c, target.key_a, "GET", path).json()
        [instance] = (body["deployments"][0] if "deployments" in body else body)["instances"]
        assert instance["state"] == "ready" and not internal & set(instance), instance
    [admin_view] = c.deployment("a-lin")["instances"]
    assert internal <= set(admin_view) and admin_view["pid"] > 0


def test_a_key_without_bearer_is_not_reported_missing(target: Target) -> None:
    c = target.cloud
    for value, message in (
        (target.key_a, "holds a key without its scheme"),
        (f"Token {target.key_a}", "uses the 'Token' scheme"),
        ("Bearer", "says 'Bearer' but holds no key"),
    ):
        answer = httpx.get(f"{c.url}/admin/deployments", headers={"Authorization": value}, timeout=30)
        assert answer.status_code == 401 and message in answer.json()["error"], answer.text
        assert target.key_a.split("_", 2)[2] not in answer.text  # no key text in the answer
    missing = httpx.get(f"{c.url}/admin/deployments", timeout=30)
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]


def test_a_wrong_model_name_suggests_the_close_ones(target: Target) -> None:
    c = target.cloud
    for body in ({"name": "x", "model": "linaer"}, {"name": "x", "model": "Linear", "octants": 1}):
        refused = call(c, target.key_a, "POST", "/admin/deployments", body)
        error = refused.json()["error"]
        assert refused.status_code == 404 and "did you mean 'linear'?" in error, refused.text
        assert "`octacloud models list` shows the models it holds" in error
    far = call(c, target.key_a, "POST", "/admin/deployments", {"name": "x", "model": "resnet50"}).json()["error"]
    assert "did you mean" not in far and "octacloud models list" in far
    assert "x" not in names(c)
