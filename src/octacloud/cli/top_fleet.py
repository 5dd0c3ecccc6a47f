"""``octacloud top``'s view of the fleet at any size: a colour per deployment however many there are, the
dashboard document narrowed by ``--node``, ``--deployment`` and ``--tenant`` (glob patterns, as ``octacloud
status`` takes them), and a fleet too big to draw card by card summarised one row per rack.

Pure functions of the dashboard document (``/dashboard/api/state``) into rich renderables.
"""

from __future__ import annotations

import colorsys
import fnmatch
from collections import Counter
from collections.abc import Iterable
from typing import Any

from rich.console import RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from octacloud.cli.status_view import NODE_ROWS, REPLICA_ROWS, STATES, Filters
from octacloud.core.units import MILLI_PER_OCTANT, OCTANTS_PER_GPU

OCTANT, FREE, OTHER = "■", "·", "□"
"""An octant held (coloured by deployment), free, or held by a deployment the filters leave out."""
GOLDEN = 0.618033988749895
BAR = 10


def palette(names: Iterable[str]) -> dict[str, str]:
    """A colour per name, distinct at any count: the sorted names' hues a golden ratio apart (no two of the
    first hundred within 2° of each other), in three bands of lightness so that neighbours differ twice."""
    out = {}
    for i, name in enumerate(sorted(set(names))):
        r, g, b = colorsys.hls_to_rgb((i * GOLDEN) % 1.0, (0.45, 0.6, 0.35)[i % 3], 0.7)
        out[name] = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
    return out


def narrow(state: dict[str, Any], filters: Filters) -> dict[str, Any]:
    """The document with only the nodes, deployments, replicas and tenants the filters match. A deployment or
    tenant filter keeps the nodes its replicas run on (unless ``--node`` picks the nodes)."""
    if not (filters.node or filters.deployment or filters.tenant):
        return state
    replicas = [
        r
        for r in state["replicas"]
        if _match(filters.node, r.get("node") or "")
        and _match(filters.deployment, r["deployment"])
        and _match(filters.tenant, r.get("tenant") or "")
    ]
    running = {r["deployment"] for r in replicas}
    deployments = [
        d
        for d in state["deployments"]
        if _match(filters.deployment, d["name"])
        and _match(filters.tenant, d.get("tenant") or "")
        and (not filters.node or d["name"] in running)
    ]
    nodes = state["fleet"]["nodes"]
    if filters.node:
        nodes = [n for n in nodes if _match(filters.node, n["name"])]
    else:
        used = {r["node"] for r in replicas if r.get("node")}
        nodes = [n for n in nodes if n["name"] in used]
    tenants = [t for t in state["tenants"] if _match(filters.tenant, str(t["tenant"]))]
    fleet = {**state["fleet"], "nodes": nodes}
    return {**state, "fleet": fleet, "deployments": deployments, "replicas": replicas, "tenants": tenants}


def fleet_view(
    nodes: list[dict[str, Any]], colours: dict[str, str], shown: set[str] | None, filters: Filters
) -> list[RenderableType]:
    """Every card of every node (one cell per octant) when that fits a screen, else one row per rack. Octants of
    deployments not in ``shown`` (None: all are) are drawn as :data:`OTHER`."""
    if filters.node or len(nodes) <= NODE_ROWS:
        return [node_panel(n, colours, shown) for n in nodes]
    return [racks_table(nodes, shown)]


def node_panel(node: dict[str, Any], colours: dict[str, str], shown: set[str] | None) -> Panel:
    lines = Text()
    for card in node["cards"]:
        lines.append(f"card {card['index']:>2} {card['model'][:10]:<10} ")
        for cell in card["octants"]:
            if cell is None:
                lines.append(FREE, style="grey50")
            elif shown is not None and cell["deployment"] not in shown:
                lines.append(OTHER, style="grey50")
            else:
                style = colours.get(cell["deployment"], "white") + ("" if cell["state"] == "ready" else " dim")
                lines.append(OCTANT, style=style)
        t = card.get("telemetry") or {}
        label = "util" if t.get("source") == "nvml" else "busy"
        memory = t.get("memory_used_mib")
        lines.append(f"  {(1000 - card['free_milli']) // 125}/8  {label} {_pct(t.get('utilisation')):>5}")
        lines.append("" if memory is None else f"  {memory:,.0f} MiB")
        if not card["usable"]:
            lines.append("  unusable", style="red")
        lines.append("\n")
    lines.rstrip()
    d = node.get("domains") or {}
    where = "/".join(d.get(k) or "-" for k in ("zone", "rack", "power_feed")) if any(d.values()) else ""
    title = f"{node['name']} ({node['health']})" + (f" {where}" if where else "")
    return Panel(lines, title=title, expand=False)


def racks_table(nodes: list[dict[str, Any]], shown: set[str] | None) -> Table:
    """One row per rack: its nodes by health, its cards, the octants held (and by how many deployments)."""
    racks: dict[str, list[dict[str, Any]]] = {}
    for n in nodes:
        racks.setdefault((n.get("domains") or {}).get("rack") or "-", []).append(n)
    table = Table(title=f"fleet by rack ({len(nodes)} nodes; --node PATTERN draws their cards)", title_justify="left")
    for col in ("rack", "zone", "nodes", "healthy", "cards", "octants held", "use", "deployments"):
        table.add_column(col, justify="left" if col in ("rack", "zone", "use") else "right")
    for rack, members in sorted(racks.items()):
        cards = [c for n in members for c in n["cards"]]
        total = len(cards) * OCTANTS_PER_GPU
        held = sum(OCTANTS_PER_GPU - c["free_milli"] // MILLI_PER_OCTANT for c in cards)
        names = {
            o["deployment"]
            for c in cards
            for o in c["octants"]
            if o is not None and (shown is None or o["deployment"] in shown)
        }
        share = held / total if total else 0.0
        table.add_row(
            rack,
            ",".join(sorted({(n.get("domains") or {}).get("zone") or "-" for n in members})),
            str(len(members)),
            str(sum(1 for n in members if n.get("health") == "healthy")),
            str(len(cards)),
            f"{held}/{total}",
            "█" * round(share * BAR) + "·" * (BAR - round(share * BAR)) + f" {_pct(share)}",
            str(len(names)),
        )
    return table


def replicas_view(replicas: list[dict[str, Any]], filters: Filters) -> Table:
    """Every replica when few (or narrowed to a node or deployment), else one row per deployment."""
    if filters.node or filters.deployment or len(replicas) <= REPLICA_ROWS:
        return replicas_table(replicas)
    return replicas_summary(replicas)


def replicas_table(replicas: list[dict[str, Any]]) -> Table:
    table = Table(title="replicas", expand=True, title_justify="left")
    for column in ("replica", "state", "slice", "busy", "cpu", "restarts", "message"):
        table.add_column(column)
    for r in replicas:
        where = f"{r['node']} {r['gpus']} × {r['milli_per_gpu'] // 125}" if r["node"] else "–"
        cpu = r["cpu_cores"]
        table.add_row(
            r["id"], r["state"], where, _pct(r["busy"]), "–" if cpu is None else f"{cpu:.2f}", str(r["restarts"]),
            r["message"][:60],
        )  # fmt: skip
    return table


def replicas_summary(replicas: list[dict[str, Any]]) -> Table:
    """One row per deployment: its replicas by state, the nodes they run on, the last problem."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in replicas:
        by.setdefault(r["deployment"], []).append(r)
    title = f"replicas by deployment ({len(replicas)} replicas; --deployment or --node lists them)"
    table = Table(title=title, expand=True, title_justify="left")
    for column in ("deployment", "tenant", *STATES, "nodes", "restarts", "last message"):
        table.add_column(column, justify="left" if column in ("deployment", "tenant", "last message") else "right")
    for name, rows in sorted(by.items()):
        states = Counter(r["state"] for r in rows)
        problems = [r["message"] for r in rows if r["state"] != "ready" and r.get("message")]
        table.add_row(
            name,
            rows[0].get("tenant") or "-",
            *(str(states.get(s, 0)) for s in STATES),
            str(len({r["node"] for r in rows if r.get("node")})),
            str(sum(r["restarts"] for r in rows)),
            problems[-1][:60] if problems else "",
        )
    return table


def _match(pattern: str, value: str) -> bool:
    return not pattern or fnmatch.fnmatchcase(value, pattern)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


__all__ = ["FREE", "OCTANT", "OTHER", "fleet_view", "narrow", "palette", "racks_table", "replicas_view"]
