"""deploy/grafana/octacloud.json: a valid Grafana dashboard whose queries use only documented metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .test_exporter import documented

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "octacloud.json"
METRIC = re.compile(r"\b(?:DCGM_FI_[A-Z0-9_]+|octacloud_[a-z_]+|nv_[a-z_]+)\b")


def test_dashboard_is_importable_and_queries_documented_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] == "octacloud"
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    docs = documented()
    used: set[str] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            for name in METRIC.findall(t["expr"]):
                family = re.sub(r"_bucket$", "", name)
                assert family in docs, f"panel {p['title']!r} queries {name}, which docs/monitoring.md does not list"
                used.add(family)
    # every GPU field and every CPU-card equivalent has a panel
    wanted = {n for n in docs if n.startswith(("DCGM_FI_", "octacloud_cpu_card_"))}
    assert wanted <= used, f"no panel for {sorted(wanted - used)}"
