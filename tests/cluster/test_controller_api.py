"""The rollout and controller routes of the admin API, and ``octacloud rollout`` over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from octacloud.admin.api import build_admin_app
from octacloud.cli.main import app as cli

from .controller_fakes import Harness


async def test_rollout_routes_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path)
    h.deploy("a", octants=2)
    await h.reconcile()
    await h.health()
    h.deploy("a", octants=2, version="2")
    await h.reconcile()
    await h.health()
    client = TestClient(build_admin_app(h.controller))
    status = client.get("/admin/deployments/a/rollout").json()
    assert status["revision"] == 2 and status["complete"] and status["version"] == "2"
    assert client.get("/admin/deployments/nope/rollout").status_code == 404
    assert client.post("/admin/deployments/a/rollout/undo", json={"revision": "x"}).status_code == 400
    assert client.post("/admin/deployments/a/rollout/undo", json={"revision": 9}).status_code == 404
    controller = client.get("/admin/controller").json()
    assert controller["running"] is False and controller["ready"] is False  # no loop runs in this test

    def request(method: str, url: str, json: Any = None, **_: Any) -> httpx.Response:
        return client.request(method, url.removeprefix("http://x"), json=json)

    monkeypatch.setattr("octacloud.cli.cloud.httpx.request", request)
    shown = CliRunner().invoke(cli, ["rollout", "status", "a", "--url", "http://x"])
    assert shown.exit_code == 0, shown.output
    assert "revision 2" in shown.output and "complete" in shown.output
    undone = CliRunner().invoke(cli, ["rollout", "undo", "a", "--url", "http://x"])
    assert undone.exit_code == 0, undone.output
    assert "revision 3" in undone.output and "in progress" in undone.output
    missing = CliRunner().invoke(cli, ["rollout", "undo", "nope", "--url", "http://x"])
    assert missing.exit_code == 1 and "no deployment" in missing.output
