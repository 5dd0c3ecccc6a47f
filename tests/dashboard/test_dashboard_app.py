"""The dashboard's ASGI app on its own: static files are public, the data needs the authorizer's yes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from starlette.testclient import TestClient

from octacloud.admin.dashboard.app import build_dashboard_app, build_metrics_app

KEY = "oc_0123456789ab_" + "s" * 43


def authorize(headers: Mapping[str, str]) -> bool:
    return headers.get("authorization") == f"Bearer {KEY}"


def test_static_files_are_public_and_data_needs_the_key() -> None:
    asked: list[float] = []

    def state(since: float) -> dict[str, Any]:
        asked.append(since)
        return {"fleet": {"nodes": []}}

    client = TestClient(build_dashboard_app(state, authorize))
    assert client.get("/dashboard", follow_redirects=False).headers["location"] == "/dashboard/"
    page = client.get("/dashboard/")
    assert page.status_code == 200 and "<title>octacloud" in page.text
    assert 'name="referrer" content="no-referrer"' in page.text
    assert client.get("/dashboard/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/dashboard/fleet.js").headers["content-type"].startswith("text/javascript")
    assert '<script src="/dashboard/fleet.js">' in page.text
    assert client.get("/dashboard/dashboard.css").status_code == 200
    assert client.get("/dashboard/secrets.txt").status_code == 404
    denied = client.get("/dashboard/api/state")
    assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
    assert asked == []  # nothing is computed for a caller without the key
    ok = client.get("/dashboard/api/state?since=12.5", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json() == {"fleet": {"nodes": []}}
    assert ok.headers["cache-control"] == "no-store"
    assert asked == [12.5]
    bad = client.get("/dashboard/api/state?since=yesterday", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400


def test_the_page_never_puts_the_key_in_a_url() -> None:
    client = TestClient(build_dashboard_app(lambda since: {}, authorize))
    script = client.get("/dashboard/dashboard.js").text
    assert "sessionStorage" in script and "Authorization: `Bearer ${key}`" in script
    assert "?key=" not in script and "localStorage" not in script


def test_a_big_document_goes_compressed_to_a_client_that_accepts_it() -> None:
    from .big_fleet import big_document

    doc = big_document()
    client = TestClient(build_dashboard_app(lambda since: doc, authorize))
    auth = {"Authorization": f"Bearer {KEY}"}
    packed = client.get("/dashboard/api/state", headers={**auth, "Accept-Encoding": "gzip"})
    assert packed.status_code == 200 and packed.headers["content-encoding"] == "gzip"
    assert packed.json() == json.loads(json.dumps(doc))
    assert int(packed.headers["content-length"]) < len(json.dumps(doc)) / 5
    plain = client.get("/dashboard/api/state", headers={**auth, "Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.json() == packed.json()
    denied = client.get("/dashboard/api/state", headers={"Accept-Encoding": "gzip"})
    assert denied.status_code == 401  # compressed or not, nothing without the key


def test_metrics_need_the_key() -> None:
    registry = CollectorRegistry()
    Gauge("octacloud_example", "An example.", registry=registry).set(3)
    client = TestClient(build_metrics_app(registry, authorize))
    assert client.get("/metrics").status_code == 401
    ok = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "octacloud_example 3.0" in ok.text
