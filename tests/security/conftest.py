"""Fixtures for security tests: a cloud with the tiny linear model, tenants and their keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config


def call(c: CloudThread, key: str | None, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, f"{c.url}{path}", json=body, headers=headers, timeout=30)


def make_tenant(c: CloudThread, name: str, **quota: Any) -> str:
    """Create a tenant as the admin and return a fresh key for it."""
    created = call(c, c.key, "POST", "/admin/tenants", {"name": name, **quota})
    assert created.status_code == 201, created.text
    key = call(c, c.key, "POST", "/admin/keys", {"tenant": name})
    assert key.status_code == 201, key.text
    text: str = key.json()["key"]
    return text


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[CloudThread]:
    repo = tmp_path / "models"
    write_linear_model(repo)
    c = CloudThread(config(tmp_path, repo))
    yield c
    c.stop(stop_replicas=True)
