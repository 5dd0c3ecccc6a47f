"""Every endpoint and protocol refuses requests without a valid key; tenants are isolated from each other;
quotas and rate limits hold; keys appear in no log, error message or replica log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS
from tests.cluster.conftest import IN, expected_output
from tests.cluster.test_cloud_e2e import CloudThread, ready_ids, wait_until

from .conftest import call, make_tenant

pytestmark = pytest.mark.slow

X = np.arange(2 * IN, dtype=np.float32).reshape(2, IN) / 10


def infer_body() -> dict[str, object]:
    return {"inputs": [{"name": "INPUT0", "shape": [2, IN], "datatype": "FP32", "data": X.ravel().tolist()}]}


REST_ENDPOINTS = [
    ("GET", "/v2", None),
    ("GET", "/v2/models/a-lin", None),
    ("GET", "/v2/models/a-lin/ready", None),
    ("GET", "/v2/models/a-lin/config", None),
    ("POST", "/v2/models/a-lin/infer", infer_body()),
    ("GET", "/admin/deployments", None),
    ("GET", "/admin/deployments/a-lin", None),
    ("POST", "/admin/deployments", {"name": "evil", "model": "linear"}),
    ("POST", "/admin/deployments/a-lin/scale", {"replicas": 1}),
    ("DELETE", "/admin/deployments/a-lin", None),
    ("GET", "/admin/fleet", None),
    ("GET", "/admin/events", None),
    ("GET", "/admin/usage", None),
    ("GET", "/admin/tenants", None),
    ("POST", "/admin/tenants", {"name": "evil"}),
    ("POST", "/admin/tenants/a/disable", {}),
    ("GET", "/admin/keys", None),
    ("POST", "/admin/keys", {"tenant": "a"}),
    ("DELETE", "/admin/keys/000000000000", None),
    ("GET", "/metrics", None),  # the monitoring apps check keys with the same Guard
    ("GET", "/dashboard/api/state", None),
]


def grpc_calls(client: grpcclient.InferenceServerClient, meta: dict[str, str]) -> list[tuple[str, object]]:
    inp = grpcclient.InferInput("INPUT0", [2, IN], "FP32")
    inp.set_data_from_numpy(X)
    return [
        ("ServerMetadata", lambda: client.get_server_metadata(headers=meta)),
        ("ModelReady", lambda: client.is_model_ready("a-lin", headers=meta)),
        ("ModelMetadata", lambda: client.get_model_metadata("a-lin", headers=meta)),
        ("ModelConfig", lambda: client.get_model_config("a-lin", headers=meta)),
        ("ModelStatistics", lambda: client.get_inference_statistics("a-lin", headers=meta)),
        ("ModelInfer", lambda: client.infer("a-lin", [inp], headers=meta)),
    ]


def test_keys_tenants_isolation_quotas_and_rates(cloud: CloudThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key_a = make_tenant(cloud, "a", octants=4, deployments=2)
    key_b = make_tenant(cloud, "b")
    key_c = make_tenant(cloud, "c")
    revoked = make_tenant(cloud, "r")
    key_slow = make_tenant(cloud, "slow", requests_per_s=0.2, burst=2)
    assert call(cloud, key_a, "POST", "/admin/deployments", {"name": "a-lin", "model": "linear"}).status_code == 201
    assert call(cloud, key_b, "POST", "/admin/deployments", {"name": "b-lin", "model": "linear"}).status_code == 201
    wait_until("both deployments ready", lambda: bool(ready_ids(cloud, "a-lin") and ready_ids(cloud, "b-lin")))
    revoked_id = revoked.split("_")[1]
    assert call(cloud, cloud.key, "DELETE", f"/admin/keys/{revoked_id}").status_code == 200
    assert call(cloud, cloud.key, "POST", "/admin/tenants/c/disable", {}).json()["disabled"] is True
    a_secret_tail = key_a.split("_", 2)[2]
    bad_keys = {
        "none": None,
        "malformed": "letmein",
        "wrong secret": key_a[: -len(a_secret_tail)] + "x" * len(a_secret_tail),
        "unknown id": "oc_ffffffffffff_" + a_secret_tail,
        "revoked": revoked,
        "disabled tenant": key_c,
    }
    every_key = [cloud.key, key_a, key_b, key_c, revoked, key_slow, bad_keys["wrong secret"]]

    # ---- no valid key: refused on every REST and admin endpoint, and on every gRPC call -------------------
    bodies: list[str] = []
    for what, key in bad_keys.items():
        for method, path, body in REST_ENDPOINTS:
            response = call(cloud, key, method, path, body)
            assert response.status_code == 401, (what, method, path, response.text)
            assert response.headers["www-authenticate"].startswith("Bearer")
            bodies.append(response.text)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{cloud.cloud.grpc_port}")
        meta = {} if key is None else {"authorization": f"Bearer {key}"}
        for name, rpc in grpc_calls(client, meta):
            with pytest.raises(InferenceServerException) as refused:
                rpc()  # type: ignore[operator]
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED", (what, name)
            bodies.append(str(refused.value))
        client.close()
    # health stays open (load balancers probe it): REST and gRPC
    assert call(cloud, None, "GET", "/v2/health/live").status_code == 200
    assert call(cloud, None, "GET", "/v2/health/ready").status_code == 200
    open_client = grpcclient.InferenceServerClient(f"127.0.0.1:{cloud.cloud.grpc_port}")
    assert open_client.is_server_live() and open_client.is_server_ready()
    open_client.close()

    # ---- tenant a cannot see, infer on, scale, delete or read usage of b's deployment -----------------------
    listed = call(cloud, key_a, "GET", "/admin/deployments").json()["deployments"]
    assert [d["spec"]["name"] for d in listed] == ["a-lin"]
    not_found = call(cloud, key_a, "GET", "/admin/deployments/nope").json()["error"]
    for method, path, body in [
        ("GET", "/admin/deployments/b-lin", None),
        ("POST", "/admin/deployments/b-lin/scale", {"replicas": 1}),
        ("DELETE", "/admin/deployments/b-lin", None),
    ]:
        response = call(cloud, key_a, method, path, body)
        assert response.status_code == 404, (method, path)
        assert response.json()["error"] == not_found.replace("nope", "b-lin")  # exactly as if it did not exist
    for path in ("/v2/models/b-lin", "/v2/models/b-lin/ready"):
        hidden_one, missing = call(cloud, key_a, "GET", path), call(cloud, key_a, "GET", path.replace("b-lin", "zz"))
        assert hidden_one.status_code == missing.status_code == 404
        assert hidden_one.json()["error"] == missing.json()["error"].replace("zz", "b-lin")
    assert call(cloud, key_a, "POST", "/v2/models/b-lin/infer", infer_body()).status_code == 404
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{cloud.cloud.grpc_port}")
    inp = grpcclient.InferInput("INPUT0", [2, IN], "FP32")
    inp.set_data_from_numpy(X)
    with pytest.raises(InferenceServerException) as hidden:
        g.infer("b-lin", [inp], headers={"authorization": f"Bearer {key_a}"})
    assert hidden.value.status() == "StatusCode.NOT_FOUND"
    assert call(cloud, key_a, "GET", "/admin/usage?tenant=b").status_code == 404
    assert all(line["tenant"] == "a" for line in call(cloud, key_a, "GET", "/admin/usage").json()["lines"])
    assert call(cloud, key_a, "GET", "/admin/fleet").status_code == 403
    assert call(cloud, key_a, "GET", "/metrics").status_code == 401  # the whole cloud's figures: admin only
    assert call(cloud, cloud.key, "GET", "/metrics").status_code == 200
    assert call(cloud, key_a, "GET", "/admin/tenants").json()["tenants"][0]["name"] == "a"
    assert [k["tenant"] for k in call(cloud, key_a, "GET", "/admin/keys?tenant=b").json()["keys"]] == ["a"]
    assert call(cloud, key_a, "POST", "/admin/keys", {"tenant": "b"}).status_code == 403
    assert (
        call(cloud, key_a, "POST", "/admin/deployments", {"name": "x", "model": "linear", "tenant": "b"}).status_code
        == 403
    )
    assert call(cloud, key_a, "POST", "/admin/deployments", {"name": "b-lin", "model": "linear"}).status_code == 409
    events = call(cloud, key_a, "GET", "/admin/events?limit=500").json()["events"]
    assert events and all(e["subject"].startswith("a-lin") for e in events)
    # ... while a and the admin use a-lin, over REST and gRPC
    client = httpclient.InferenceServerClient(cloud.url.removeprefix("http://"))
    inp_h = httpclient.InferInput("INPUT0", [2, IN], "FP32")
    inp_h.set_data_from_numpy(X)
    out = client.infer("a-lin", [inp_h], headers={"Authorization": f"Bearer {key_a}"}).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, expected_output(X), rtol=1e-5, atol=1e-5)
    client.close()
    out = g.infer("a-lin", [inp], headers={"authorization": f"Bearer {cloud.key}"}).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, expected_output(X), rtol=1e-5, atol=1e-5)

    # ---- quotas: refused with a clear message, nothing changed ---------------------------------------------
    over = call(cloud, key_a, "POST", "/admin/deployments", {"name": "a-big", "model": "linear", "octants": 4})
    assert over.status_code == 403 and "may hold 4 octant(s)" in over.json()["error"], over.text
    grow = {"name": "a-lin", "model": "linear", "min_replicas": 1, "max_replicas": 5}
    assert call(cloud, key_a, "POST", "/admin/deployments", grow).status_code == 403
    assert call(cloud, key_a, "POST", "/admin/deployments", {"name": "a-2", "model": "linear", "min_replicas": 0,
                                                              "max_replicas": 0}).status_code == 201  # fmt: skip
    third = call(cloud, key_a, "POST", "/admin/deployments", {"name": "a-3", "model": "linear", "min_replicas": 0,
                                                               "max_replicas": 0})  # fmt: skip
    assert third.status_code == 403 and "may have 2 deployment(s)" in third.json()["error"]
    names = sorted(d["spec"]["name"] for d in call(cloud, key_a, "GET", "/admin/deployments").json()["deployments"])
    assert names == ["a-2", "a-lin"]
    assert cloud.deployment("a-lin")["spec"]["max_replicas"] == DEFAULT_MAX_REPLICAS  # refused: left as it was
    assert call(cloud, key_a, "POST", "/admin/tenants/a/quota", {"octants": 64}).status_code == 403
    raised = call(cloud, cloud.key, "POST", "/admin/tenants/a/quota", {"octants": 12})
    assert raised.status_code == 200 and raised.json()["quota"] == {
        "octants": 12,
        "deployments": 2,
        "requests_per_s": None,
        "burst": 50,
        "tokens_per_minute": None,
        "max_streams": None,
    }
    big = {"name": "a-lin", "model": "linear", "octants": 1, "min_replicas": 1, "max_replicas": 13}
    over = call(cloud, key_a, "POST", "/admin/deployments", big)  # the new quota applies at once
    assert over.status_code == 403 and "may hold 12 octant(s)" in over.json()["error"], over.text

    # ---- published: every tenant may infer, only the owner may manage ------------------------------------
    pub = call(cloud, key_b, "POST", "/admin/deployments", {"name": "b-lin", "model": "linear", "published": True})
    assert pub.status_code == 201
    response = call(cloud, key_a, "POST", "/v2/models/b-lin/infer", infer_body())
    assert response.status_code == 200, response.text
    assert call(cloud, key_a, "POST", "/admin/deployments/b-lin/scale", {"replicas": 1}).status_code == 404

    # ---- rate limit: 429 + Retry-After on REST, RESOURCE_EXHAUSTED on gRPC --------------------------------
    codes = [call(cloud, key_slow, "GET", "/v2/models/b-lin/ready").status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    limited = call(cloud, key_slow, "GET", "/v2/models/b-lin/ready")
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    with pytest.raises(InferenceServerException) as exhausted:
        g.is_model_ready("b-lin", headers={"authorization": f"Bearer {key_slow}"})
    assert exhausted.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    g.close()
    assert call(cloud, key_b, "GET", "/v2/models/b-lin/ready").status_code == 200  # other tenants unaffected

    # ---- no key text in any error, log line or replica log ------------------------------------------------
    secrets = [k.split("_", 2)[2] for k in every_key]
    logs = caplog.text + "".join(p.read_text() for p in Path(cloud.cloud.config.state_dir).rglob("*.log"))
    for text in [*bodies, logs, json.dumps(call(cloud, cloud.key, "GET", "/admin/events?limit=1000").json())]:
        for secret in secrets:
            assert secret not in text
    assert "invalid API key" in "".join(bodies) and "revoked" in "".join(bodies) and "disabled" in "".join(bodies)
