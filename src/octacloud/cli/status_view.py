"""What ``octacloud status`` shows of a fleet: filtered by node, deployment and tenant, and summarised once it
is too big to read row by row (nodes by rack, replicas by deployment), so that a thousand cards fit a screen.

Pure functions of the admin API's JSON (``/admin/deployments``, ``/admin/fleet``) into rich tables.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from octacloud.core.units import MILLI_PER_OCTANT, OCTANTS_PER_GPU

NODE_ROWS = 24
"""More nodes than this (with no ``--node``) are shown by rack."""
REPLICA_ROWS = 60
"""More replicas than this (with no ``--node``, ``--deployment`` or ``--replicas``) are shown by deployment."""
STATES = ("ready", "starting", "pending", "failed", "stopping")


@dataclass(frozen=True)
class Filters:
    """Glob patterns (``r01-*``); empty matches everything."""

    node: str = ""
    deployment: str = ""
    tenant: str = ""

    def nodes(self, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [n for n in nodes if _match(self.node, n["name"])]

    def deployments(self, deployments: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deployments that match, each with only its replicas on matching nodes (and none left out for
        having no replica, unless a node was asked for)."""
        out = []
        for d in deployments:
            spec = d["spec"]
            if not (_match(self.deployment, spec["name"]) and _match(self.tenant, spec.get("tenant", ""))):
                continue
            instances = [r for r in d["instances"] if _match(self.node, r.get("node", "") or "")]
            if self.node and not instances:
                continue
            out.append({**d, "instances": instances})
        return out


def _match(pattern: str, value: str) -> bool:
    return not pattern or fnmatch.fnmatchcase(value, pattern)


def _free(cards: list[dict[str, Any]]) -> int:
    return sum(int(c.get("free_milli", 0)) for c in cards) // MILLI_PER_OCTANT


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(title="nodes")
    for col in ("node", "health", "zone", "rack", "power feed", "cards", "free octants"):
        table.add_column(col)
    for n in nodes:
        domains = n.get("domains") or {}
        cards = n.get("cards") or []
        table.add_row(
            n["name"],
            n.get("health", "-"),
            *(domains.get(kind) or "-" for kind in ("zone", "rack", "power_feed")),
            str(len(cards)),
            f"{_free(cards)}/{len(cards) * OCTANTS_PER_GPU}",
        )
    return table


def racks_table(nodes: list[dict[str, Any]]) -> Table:
    """One row per rack (nodes without one together): nodes by health, cards, free octants."""
    racks: dict[str, list[dict[str, Any]]] = {}
    for n in nodes:
        racks.setdefault((n.get("domains") or {}).get("rack") or "-", []).append(n)
    table = Table(title=f"nodes by rack ({len(nodes)} nodes; --node PATTERN lists them)")
    for col in ("rack", "zone", "nodes", "healthy", "not healthy", "cards", "free octants"):
        table.add_column(col)
    for rack, members in sorted(racks.items()):
        zones = sorted({(n.get("domains") or {}).get("zone") or "-" for n in members})
        unwell = Counter(n.get("health", "-") for n in members if n.get("health") != "healthy")
        cards = [c for n in members for c in n.get("cards") or []]
        table.add_row(
            rack,
            ",".join(zones),
            str(len(members)),
            str(len(members) - sum(unwell.values())),
            ", ".join(f"{k} {v}" for k, v in sorted(unwell.items())) or "-",
            str(len(cards)),
            f"{_free(cards)}/{len(cards) * OCTANTS_PER_GPU}",
        )
    return table


def replicas_table(deployments: list[dict[str, Any]]) -> Table:
    table = Table(title="deployments")
    for col in ("deployment", "model", "want", "octants", "replica", "state", "node", "cards", "milli", "message"):
        table.add_column(col)
    for d in deployments:
        spec = d["spec"]
        for r in d["instances"] or [{}]:
            table.add_row(
                spec["name"],
                spec["model"],
                str(d["replicas"]),
                str(d["octants"]),
                r.get("id", "-"),
                r.get("state", "-"),
                r.get("node", "") or "-",
                ",".join(map(str, r.get("gpus", []))) or "-",
                str(r.get("milli_per_gpu", "")),
                r.get("message", ""),
            )
    return table


def summary_table(deployments: list[dict[str, Any]]) -> Table:
    """One row per deployment: its replicas counted by state, and on how many nodes they run."""
    total = sum(len(d["instances"]) for d in deployments)
    table = Table(title=f"deployments ({total} replicas; --replicas, --deployment or --node lists them)")
    for col in ("deployment", "tenant", "model", "want", "octants", *STATES, "nodes", "last message"):
        table.add_column(col)
    for d in deployments:
        spec, instances = d["spec"], d["instances"]
        states = Counter(r.get("state", "") for r in instances)
        problems = [r.get("message", "") for r in instances if r.get("state") != "ready" and r.get("message")]
        table.add_row(
            spec["name"],
            spec.get("tenant", "") or "-",
            spec["model"],
            str(d["replicas"]),
            str(d["octants"]),
            *(str(states.get(s, 0)) for s in STATES),
            str(len({r["node"] for r in instances if r.get("node")})),
            problems[-1] if problems else "",
        )
    return table


def status_tables(
    deployments: list[dict[str, Any]], nodes: list[dict[str, Any]], filters: Filters, every_replica: bool = False
) -> list[Table]:
    """The tables ``octacloud status`` prints, nodes first (when the key may see them)."""
    out = []
    shown_nodes = filters.nodes(nodes)
    if shown_nodes:
        out.append(
            nodes_table(shown_nodes) if filters.node or len(shown_nodes) <= NODE_ROWS else racks_table(shown_nodes)
        )
    shown = filters.deployments(deployments)
    rows = sum(max(1, len(d["instances"])) for d in shown)
    narrowed = every_replica or filters.node or filters.deployment
    out.append(replicas_table(shown) if narrowed or rows <= REPLICA_ROWS else summary_table(shown))
    return out
