"""The operator's commands as a user sees them: keys found where `up` saved them, events with times, tables
whole when piped, usage by tenant without an empty column, and auto-sizing's reasoning printed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from octacloud.cli import cloud
from octacloud.cli.main import app


class FakeAdmin:
    """The admin API's answers, and what the CLI sent."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, str, dict[str, str], Any]] = []

    def __call__(self, method: str, url: str, json: Any = None, headers: Any = None, **_: Any) -> httpx.Response:
        path = httpx.URL(url).path
        self.sent.append((method, path, dict(headers or {}), json))
        if path not in self.answers:
            return httpx.Response(404, json={"error": f"no route {path}"})
        return httpx.Response(200, json=self.answers[path])


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeAdmin:
    fake = FakeAdmin({})
    monkeypatch.setattr(cloud.httpx, "request", fake)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OCTACLOUD_KEY", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    return fake


def _deployments(n: int) -> dict[str, Any]:
    spec = {"name": "a-deployment-with-a-long-name", "model": "a-model-with-a-long-name-too"}
    instance = {"id": "a-deployment-with-a-long-name-0f0f0f", "state": "ready", "node": "demo-a", "gpus": [3],
                "milli_per_gpu": 125, "message": "a message long enough to pass the eighty columns"}  # fmt: skip
    return {"deployments": [{"spec": spec, "replicas": n, "octants": 1, "instances": [instance] * n}]}


def test_status_reads_the_key_up_saved_and_prints_whole_rows_when_piped(admin: FakeAdmin, tmp_path: Path) -> None:
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin.key").write_text("oc_saved\n")
    admin.answers["/admin/deployments"] = _deployments(2)
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert admin.sent[0][2]["Authorization"] == "Bearer oc_saved"
    row = next(line for line in result.output.splitlines() if "0f0f0f" in line)
    assert "a-deployment-with-a-long-name-0f0f0f" in row and "pass the eighty columns" in row  # one line, uncut
    assert len(row) > 80


def test_a_given_key_wins_over_the_saved_one(admin: FakeAdmin, tmp_path: Path) -> None:
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin.key").write_text("oc_saved\n")
    admin.answers["/admin/deployments"] = _deployments(1)
    assert CliRunner().invoke(app, ["status", "--key", "oc_given"]).exit_code == 0
    assert admin.sent[0][2]["Authorization"] == "Bearer oc_given"


def test_status_shows_the_fleet_with_its_failure_domains_to_an_admin(admin: FakeAdmin) -> None:
    admin.answers["/admin/deployments"] = _deployments(1)
    card = {"index": 0, "free_milli": 625}
    admin.answers["/admin/fleet"] = {
        "nodes": [
            {"name": "gpu-a", "health": "healthy", "domains": {"zone": "eu-1", "rack": "r12", "power_feed": "pdu-1"},
             "cards": [card, {"index": 1, "free_milli": 1000}]},
            {"name": "gpu-b", "health": "failed", "domains": {"zone": "", "rack": "", "power_feed": ""}, "cards": []},
        ]
    }  # fmt: skip
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "gpu-a" in line).split()
    assert [w for w in row if w not in "│┃"] == ["gpu-a", "healthy", "eu-1", "r12", "pdu-1", "2", "13/16"]
    row = next(line for line in result.output.splitlines() if "gpu-b" in line).split()
    assert [w for w in row if w not in "│┃"] == ["gpu-b", "failed", "-", "-", "-", "0", "0/0"]
    shown = CliRunner().invoke(app, ["status", "--json"])
    assert '"rack": "r12"' in shown.output


def test_status_without_the_fleet_for_a_tenant_key(admin: FakeAdmin) -> None:
    admin.answers["/admin/deployments"] = _deployments(1)  # /admin/fleet answers 404 here (403 for a tenant)
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "nodes" not in result.output and "0f0f0f" in result.output


def test_events_show_their_times(admin: FakeAdmin) -> None:
    at = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    admin.answers["/admin/events"] = {"events": [{"at": at, "kind": "ready", "subject": "mlp-1", "message": "ok"}]}
    result = CliRunner().invoke(app, ["events"])
    assert result.exit_code == 0, result.output
    assert "2026-03-04 05:06:07" in result.output


def test_usage_by_tenant_has_one_tenant_column(admin: FakeAdmin) -> None:
    line = {"tenant": "acme", "group": "", "octant_seconds": 1.0, "exec_seconds": 0.5, "inferences": 3,
            "requests": 3, "bytes_in": 10, "bytes_out": 20, "storage_gb_months": 0.0, "cost": 0.0}  # fmt: skip
    total = {**line, "tenant": "total"}
    admin.answers["/admin/usage"] = {"by": "tenant", "lines": [line], "total": total, "currency": None}
    result = CliRunner().invoke(app, ["usage", "--by", "tenant"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "octant-s" in line)
    cells = [c.strip() for c in header.strip("┃│ ").split("┃")]
    assert cells[:2] == ["tenant", "octant-s"], cells
    row = next(line for line in result.output.splitlines() if "acme" in line)
    assert [c.strip() for c in row.strip("│ ").split("│")][:2] == ["acme", "1.0"]


def test_usage_shows_energy_next_to_octant_seconds(admin: FakeAdmin) -> None:
    line = {"tenant": "acme", "group": "web", "octant_seconds": 80.0, "exec_seconds": 0.5, "inferences": 3,
            "requests": 3, "bytes_in": 10, "bytes_out": 20, "storage_gb_months": 0.0, "energy_wh": 2.0833,
            "cost": 0.0}  # fmt: skip
    admin.answers["/admin/usage"] = {"by": "deployment", "lines": [line], "total": {**line, "tenant": "*"},
                                     "currency": None}  # fmt: skip
    result = CliRunner().invoke(app, ["usage"])
    assert result.exit_code == 0, result.output
    header = next(row for row in result.output.splitlines() if "octant-s" in row)
    cells = [c.strip() for c in header.strip("┃│ ").split("┃")]
    row = next(row for row in result.output.splitlines() if "acme" in row)
    assert [c.strip() for c in row.strip("│ ").split("│")][cells.index("Wh")] == "2.083"
    result = CliRunner().invoke(app, ["usage", "--format", "csv"])
    assert result.output.splitlines()[0].endswith("completion_tokens,energy_wh,cost")
    assert result.output.splitlines()[1].endswith(",2.0833,0.0")
    del line["energy_wh"]  # an older cloud's answer: no energy, shown as 0
    assert CliRunner().invoke(app, ["usage", "--format", "csv"]).output.splitlines()[1].endswith(",0,0.0")


def test_deploy_prints_how_auto_sizing_chose(admin: FakeAdmin) -> None:
    admin.answers["/admin/deployments"] = {
        "spec": {"name": "bert"},
        "replicas": 2,
        "octants": 3,
        "sizing": "needs 420 MiB ...; 2.0 samples/s per octant; target 10 req/s → 2 replica(s) × 3 octant(s)",
    }
    result = CliRunner().invoke(app, ["deploy", "bert", "--octants", "auto", "--target-qps", "10", "--key", "k"])
    assert result.exit_code == 0, result.output
    assert "deployed bert: 2 replica(s) × 3 octant(s)" in result.output
    assert "sizing: needs 420 MiB" in result.output and "per octant" in result.output
    assert admin.sent[0][3]["octants"] is None and admin.sent[0][3]["target_qps"] == 10


def _fleet(nodes: int, replicas: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fleet of ``nodes`` 8-card nodes in racks of 25, and two tenants' deployments over ``replicas``."""
    fleet = {"nodes": [
        {"name": f"r{k // 25:02d}-n{k % 25:02d}", "health": "failed" if k == 3 else "healthy",
         "domains": {"zone": "eu-1", "rack": f"r{k // 25:02d}", "power_feed": ""},
         "cards": [{"index": g, "free_milli": 500 if g == 0 else 0} for g in range(8)]}
        for k in range(nodes)
    ]}  # fmt: skip
    deployments = []
    for name, tenant, n in (("web", "acme", replicas // 2), ("batch", "beta", replicas - replicas // 2)):
        instances = [{"id": f"{name}-{k:04d}", "state": "failed" if k == 1 else "ready",
                      "node": fleet["nodes"][k % nodes]["name"], "gpus": [k % 8], "milli_per_gpu": 250,
                      "message": "launch failed: no room" if k == 1 else ""} for k in range(n)]  # fmt: skip
        deployments.append({"spec": {"name": name, "model": "mlp", "tenant": tenant}, "replicas": n, "octants": 2,
                            "instances": instances})  # fmt: skip
    return {"deployments": deployments}, fleet


def test_status_of_a_thousand_cards_is_summarised_by_rack_and_deployment(admin: FakeAdmin) -> None:
    admin.answers["/admin/deployments"], admin.answers["/admin/fleet"] = _fleet(125, 4000)
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) < 40 and "nodes by rack (125 nodes" in result.output and "4000 replicas" in result.output
    row = next(line for line in lines if line.strip("│ ").startswith("r00 ")).split()
    assert [w for w in row if w not in "│┃"] == ["r00", "eu-1", "25", "24", "failed", "1", "200", "100/1600"]
    row = [w for w in next(line for line in lines if "web" in line).split() if w not in "│┃"]
    assert row[:10] == ["web", "acme", "mlp", "2000", "2", "1999", "0", "0", "1", "0"] and row[10] == "125"
    assert "launch failed: no room" in result.output


def test_status_filters_by_node_deployment_and_tenant(admin: FakeAdmin) -> None:
    admin.answers["/admin/deployments"], admin.answers["/admin/fleet"] = _fleet(125, 4000)
    on_node = CliRunner().invoke(app, ["status", "--node", "r01-n07"])
    assert on_node.exit_code == 0, on_node.output
    shown = {w for line in on_node.output.splitlines() for w in line.split() if w.startswith(("web-", "batch-"))}
    assert len(shown) == 32 and all(
        int(r.split("-")[1]) % 125 == 32 for r in shown
    )  # the 16 replicas of each deployment on node 32, listed
    assert "r01-n08" not in on_node.output
    beta = CliRunner().invoke(app, ["status", "--tenant", "beta", "--json"])
    assert '"name": "batch"' in beta.output and '"name": "web"' not in beta.output
    one = CliRunner().invoke(app, ["status", "--deployment", "w*", "--node", "r00-*"])
    assert "web-0000" in one.output and "batch-" not in one.output and "r01-" not in one.output
    none = CliRunner().invoke(app, ["status", "--deployment", "nope"])
    assert none.exit_code == 0 and "web" not in none.output
