"""Every endpoint of the one table (protocols/endpoints.py) that the gateway offers, asked of the gateway of a real
cloud and straight of its replica: the same status class. Then a malformed path, a wrong method and a second
tenant, which the gateway must refuse as it refuses a deployment that does not exist."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from octacloud.protocols.endpoints import ENDPOINTS
from octacloud.security.internal_auth import HEADER
from tests.reliability.test_differential import Pair, json_infer, pair  # noqa: F401 (the cloud: a fixture)
from tests.security.conftest import make_tenant

pytestmark = pytest.mark.slow

_CHAT = {"model": "lin", "messages": [{"role": "user", "content": "hi"}]}
REQUESTS: dict[str, tuple[str, str, bytes]] = {
    "health_live": ("GET", "/v2/health/live", b""),
    "health_ready": ("GET", "/v2/health/ready", b""),
    "server_metadata": ("GET", "/v2", b""),
    "model_metadata": ("GET", "/v2/models/lin", b""),
    "model_ready": ("GET", "/v2/models/lin/ready", b""),
    "model_config": ("GET", "/v2/models/lin/config", b""),
    "model_stats": ("GET", "/v2/models/lin/stats", b""),
    "infer": ("POST", "/v2/models/lin/infer", json_infer()),
    "generate": ("POST", "/v2/models/lin/generate", b'{"text_input": "hi"}'),  # lin is not generative: 4xx both
    "generate_stream": ("POST", "/v2/models/lin/generate_stream", b'{"text_input": "hi"}'),
    "models": ("GET", "/v1/models", b""),
    "chat": ("POST", "/v1/chat/completions", json.dumps(_CHAT).encode()),
    "completion": ("POST", "/v1/completions", b'{"model": "lin", "prompt": "hi"}'),
    "embedding": ("POST", "/v1/embeddings", b'{"model": "lin", "input": "hi"}'),
}
"""One request of each row the gateway offers (its ``gateway`` is not ``none``)."""
ODD = {
    "malformed path": ("GET", "/v2/models/lin/versions", b""),
    "too long a path": ("GET", "/v2/models/lin/versions/1/ready/more", b""),
    "unknown action": ("GET", "/v2/models/lin/nothing", b""),
    "wrong method": ("GET", "/v2/models/lin/infer", b""),
    "unknown method": ("PUT", "/v2/models/lin/infer", json_infer()),
    "malformed body": ("POST", "/v2/models/lin/infer", b'{"inputs": [}'),
    "unknown version": ("GET", "/v2/models/lin/versions/7", b""),
}


def ask(p: Pair, direct: bool, method: str, path: str, body: bytes, key: str | None = None) -> httpx.Response:
    port = p.replica_port if direct else p.gateway_port
    headers: dict[str, Any] = {HEADER: p.secret} if direct else {"Authorization": f"Bearer {key or p.key}"}
    if body:
        headers["Content-Type"] = "application/json"
    return httpx.request(method, f"http://127.0.0.1:{port}{path}", content=body, headers=headers, timeout=60)


def test_every_row_the_gateway_offers_has_a_request_here() -> None:
    assert set(REQUESTS) == {e.name for e in ENDPOINTS if e.gateway != "none" and e.path}


@pytest.mark.parametrize("name", [*REQUESTS, *ODD])
def test_the_gateway_and_a_direct_connection_answer_in_the_same_status_class(pair: Pair, name: str) -> None:  # noqa: F811
    method, path, body = REQUESTS.get(name) or ODD[name]
    direct = ask(pair, True, method, path, body)
    through = ask(pair, False, method, path, body)
    assert direct.status_code // 100 == through.status_code // 100, (name, direct.text, through.text)
    if name in ODD:
        assert through.status_code // 100 == 4, through.text


def test_a_second_tenant_is_refused_each_per_model_row_as_an_unknown_deployment(pair: Pair) -> None:  # noqa: F811
    other = make_tenant(pair.cloud, "endpoints-b")
    for name, (method, path, body) in REQUESTS.items():
        if "lin" not in path and b'"lin"' not in body:
            continue  # no deployment named: the same for every tenant
        theirs = ask(pair, False, method, path, body, key=other)
        unknown = ask(pair, False, method, path.replace("lin", "nope"), body.replace(b'"lin"', b'"nope"'), key=other)
        assert theirs.status_code == unknown.status_code == 404, (name, theirs.text)
        assert theirs.text.replace("lin", "nope") == unknown.text, name
        assert ask(pair, False, method, path, body).status_code // 100 != 5, name  # still served to its owner
