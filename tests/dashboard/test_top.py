"""``octacloud top``'s frame from a dashboard document: the card map, load, replicas, events."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from octacloud.cli.status_view import Filters
from octacloud.cli.top import FREE, OCTANT, History, render, sparkline
from octacloud.cli.top_fleet import palette

from .big_fleet import DEPLOYMENTS, big_document


def cell(replica: str, deployment: str, state: str = "ready") -> dict[str, str]:
    return {"replica": replica, "deployment": deployment, "tenant": "acme", "state": state}


def document(at: float, qps: float) -> dict[str, Any]:
    a, b = cell("chat-1", "chat"), cell("emb-1", "embed", "starting")
    return {
        "at": at,
        "fleet": {
            "allocation": 0.3125,
            "fragmentation": 0.25,
            "nodes": [
                {
                    "name": "node-a",
                    "health": "healthy",
                    "domains": {"zone": "eu-1", "rack": "r12", "power_feed": ""},
                    "cards": [
                        {"index": 0, "model": "H100", "free_milli": 375, "usable": True,
                         "octants": [a, a, a, b, b, None, None, None],
                         "telemetry": {"source": "nvml", "utilisation": 0.42, "memory_used_mib": 20480.0}},
                        {"index": 1, "model": "H100", "free_milli": 1000, "usable": False,
                         "octants": [None] * 8, "telemetry": {}},
                    ],
                }
            ],
        },
        "allocation": [[at, 0.3125]],
        "fragmentation": [[at, 0.25]],
        "deployments": [
            {"name": "chat", "tenant": "acme", "octants": 3, "ready": 1, "desired": 1, "qps": [[at, qps]],
             "latency_ms": [[at, 12.5]], "batch_sizes": {"1": 40, "4": 3}},
        ],
        "replicas": [
            {"id": "chat-1", "state": "ready", "node": "node-a", "gpus": [0], "milli_per_gpu": 375, "busy": 0.4,
             "cpu_cores": 1.5, "restarts": 0, "message": ""},
            {"id": "emb-1", "state": "starting", "node": "node-a", "gpus": [0], "milli_per_gpu": 250, "busy": None,
             "cpu_cores": None, "restarts": 2, "message": "process exited"},
        ],
        "scheduler": {"pending": 0, "mean_decision_ms": 0.21, "preemptions": 1},
        "tenants": [{"tenant": "acme", "deployments": 2, "replicas": 2, "octants": 5,
                     "usage": {"octant_seconds": 1234.5, "requests": 98765, "inferences": 100000}}],
        "events": [{"at": at, "kind": "placed", "subject": "chat-1", "message": "node-a cards [0] × 375 milli"}],
    }  # fmt: skip


def frame(history: History, doc: dict[str, Any]) -> str:
    history.add(doc)
    console = Console(record=True, width=140, color_system=None)
    console.print(render(doc, history))
    return console.export_text()


def test_frame_shows_octants_load_replicas_and_events() -> None:
    history = History()
    frame(history, document(100.0, 5.0))
    text = frame(history, document(101.0, 10.0))
    assert text.count(OCTANT) == 5 and text.count(FREE) == 3 + 8
    assert "5/8" in text and "0/8" in text and "util  42 %" in text and "20,480 MiB" in text
    assert "unusable" in text
    assert "node-a (healthy) eu-1/r12/-" in text  # its failure domains: zone / rack / power feed
    assert "allocated 31 %" in text and "fragmented 25 %" in text
    assert "10.0" in text and "12.5 ms" in text and "1:40 4:3" in text
    assert "process exited" in text and "placed" in text
    assert "1,234.5" in text and "98,765" in text
    assert history.since == 101.0  # the next poll asks only for newer points


def test_sparkline_scales_to_the_largest_value() -> None:
    assert sparkline([[0, 0.0], [1, 5.0], [2, 10.0]]) == "▁▄█"
    assert sparkline([]) == ""


def test_fractions_draw_a_full_bar_at_100_percent_only() -> None:
    """The header's allocation and fragmentation are fractions: 12 % draws a low bar, not a full one."""
    assert sparkline([[0, 0.12], [1, 0.12]], full=1.0) == "▁▁"
    assert sparkline([[0, 0.5], [1, 1.0]], full=1.0) == "▄█"
    line = frame(History(), document(100.0, 5.0)).splitlines()[0]  # allocated 31 %, fragmented 25 %
    assert "allocated 31 % ▃" in line and "fragmented 25 % ▂" in line and "█" not in line, line


def big_frame(**filters: str) -> str:
    doc = big_document()
    console = Console(record=True, width=160, color_system=None, file=io.StringIO())
    console.print(render(doc, History(), Filters(**filters)))
    return console.export_text()


def test_a_thousand_cards_are_summarised_by_rack_and_deployment() -> None:
    """125 nodes × 8 cards, 1,000 replicas: one row per rack and per deployment, not a panel per node."""
    text = big_frame()
    lines = text.splitlines()
    assert len(lines) < 200, len(lines)
    assert text.count(OCTANT) == 0 and "fleet by rack (125 nodes" in text
    doc = big_document()
    for rack in ("r00", "r01", "r02", "r03", "r04"):
        row = next(line for line in lines if line.lstrip("│ ").startswith(rack))
        nodes = [n for n in doc["fleet"]["nodes"] if n["domains"]["rack"] == rack]
        held = sum(8 - c["free_milli"] // 125 for n in nodes for c in n["cards"])
        assert f"{held}/{25 * 64}" in row, row
    assert "r00  " in text and " 24 " in text  # r00 holds the failed node: 24 of its 25 are healthy
    assert "replicas by deployment (1000 replicas" in text
    row = next(line for line in lines if line.lstrip("│ ").startswith("model-07 "))
    assert "tenant-7" in row
    assert sum(1 for line in lines if line.lstrip("│ ").startswith("model-")) == 2 * DEPLOYMENTS  # both tables


def test_top_filters_by_node_deployment_and_tenant() -> None:
    doc = big_document()
    one = big_frame(node="r02-n03")
    node = next(n for n in doc["fleet"]["nodes"] if n["name"] == "r02-n03")
    held = sum(1 for c in node["cards"] for o in c["octants"] if o is not None)
    assert one.count(OCTANT) == held and one.count(FREE) >= 64 - held and "r02-n03 (healthy) z0/r02/-" in one
    on_node = [r["id"] for r in doc["replicas"] if r["node"] == "r02-n03"]
    assert on_node and all(rid in one for rid in on_node)  # a node filter lists its replicas one by one

    mine = big_frame(deployment="model-13")
    rows = [r for r in doc["replicas"] if r["deployment"] == "model-13"]
    assert all(r["id"] in mine for r in rows)
    nodes = {r["node"] for r in rows if r["node"]}
    assert sum(1 for n in nodes if f"{n} (" in mine) == len(nodes)  # the nodes it runs on, drawn card by card
    assert mine.count(OCTANT) == sum(r["milli_per_gpu"] // 125 for r in rows if r["node"])  # others: OTHER
    assert "model-12" not in mine.replace("model-12-", "")

    tenant = big_frame(tenant="tenant-3")
    names = {d["name"] for d in doc["deployments"] if d["tenant"] == "tenant-3"}
    rows = [line.lstrip("│ ").split(" ")[0] for line in tenant.splitlines() if line.lstrip("│ ").startswith("model-")]
    assert set(rows) == names and len(rows) == 2 * len(names)  # in the deployments and the replicas tables
    assert "replicas by deployment (125 replicas" in tenant  # 5 deployments × 25: still counted, not listed


def test_a_colour_per_deployment_at_any_count() -> None:
    colours = palette(f"d{k:03d}" for k in range(200))
    assert len(set(colours.values())) == 200
    assert palette(["b", "a"]) == palette(["a", "b"])  # by name, not by arrival
