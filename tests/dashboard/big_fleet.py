"""A dashboard document (``/dashboard/api/state``'s JSON) of a thousand-card fleet, for the tests of the views
that must stay readable at that size (the page in a browser, ``octacloud top``) and for the render benchmark.

125 nodes × 8 cards in 5 racks of 25 (the generated fleet ``octacloud fleet generate`` writes), 40 deployments of 8
tenants with 25 replicas each (1,000 replicas) of 1, 2, 4 or 8 octants, packed first fit card by card; a few
replicas starting, failed or pending, one node failed and the last 25 nodes empty.
"""

from __future__ import annotations

from typing import Any

from octacloud.control.fleet_gen import FleetShape, generated_fleet
from octacloud.core.domains import domain_dict

NODES, CARDS, RACKS = 125, 8, 5
DEPLOYMENTS, REPLICAS_EACH, TENANTS = 40, 25, 8
SIZES = (1, 2, 4, 8)
FAILED_NODE = 7


def deployment_name(k: int) -> str:
    return f"model-{k:02d}"


def big_document(
    at: float = 1_000.0,
    nodes: int = NODES,
    racks: int = RACKS,
    deployments: int = DEPLOYMENTS,
    replicas_each: int = REPLICAS_EACH,
) -> dict[str, Any]:
    """The document (by default the fleet above; the bench asks for other sizes); every replica's octants are
    exactly the cells of the cards it is placed on."""
    fleet = generated_fleet(FleetShape(nodes=nodes, cards=CARDS, racks=racks))
    free = [[8] * CARDS for _ in fleet]
    cells: list[list[list[dict[str, Any] | None]]] = [[[] for _ in range(CARDS)] for _ in fleet]
    replicas = []
    for k in range(replicas_each * deployments):
        d, n = k % deployments, k // deployments
        octants = SIZES[d % len(SIZES)]
        state = "ready" if k % 97 else "starting"
        state = "failed" if k % 331 == 5 else state
        rid = f"{deployment_name(d)}-{n:03d}"
        tenant = f"tenant-{d % TENANTS}"
        where = _first_fit(free, octants, (k * 13) % max(1, nodes * 4 // 5)) if k % 250 != 3 else None
        if where is None:
            state = "pending"
        else:
            i, g = where
            free[i][g] -= octants
            cell = {"replica": rid, "deployment": deployment_name(d), "tenant": tenant, "state": state}
            cells[i][g].extend([cell] * octants)
        replicas.append(
            {
                "id": rid, "deployment": deployment_name(d), "tenant": tenant, "state": state,
                "node": fleet[where[0]].name if where else "", "gpus": [where[1]] if where else [],
                "milli_per_gpu": octants * 125, "restarts": k % 3, "message": "" if state == "ready" else "exited 1",
                "busy": 0.25, "cpu_cores": 0.5, "rss_bytes": 64 << 20,
            }
        )  # fmt: skip
    fleet_nodes = [
        {
            "name": node.name,
            "health": "failed" if i == FAILED_NODE and nodes > FAILED_NODE + 1 else "healthy",
            "domains": domain_dict(node),
            "cards": [
                {
                    "index": g.index, "model": g.model, "memory_mib": g.memory_mib, "health": "healthy",
                    "usable": i != FAILED_NODE or nodes <= FAILED_NODE + 1, "free_milli": free[i][g.index] * 125,
                    "octants": cells[i][g.index] + [None] * free[i][g.index],
                    "telemetry": {"source": "nvml", "utilisation": 0.5, "memory_used_mib": 1024.0},
                }
                for g in node.gpus
            ],
        }
        for i, node in enumerate(fleet)
    ]  # fmt: skip
    held = sum(8 - f for row in free for f in row)
    return {
        "at": at,
        "sample_at": at,
        "fleet": {
            "nodes": fleet_nodes, "allocated_milli": held * 125, "total_milli": nodes * CARDS * 1000,
            "allocation": held / (nodes * CARDS * 8), "fragmentation": 0.1,
        },
        "allocation": [[at, held / (nodes * CARDS * 8)]],
        "fragmentation": [[at, 0.1]],
        "deployments": [
            {
                "name": deployment_name(d), "model": f"m{d % 7}", "tenant": f"tenant-{d % TENANTS}", "priority": 0,
                "octants": SIZES[d % len(SIZES)], "desired": replicas_each,
                "ready": sum(1 for r in replicas if r["deployment"] == deployment_name(d) and r["state"] == "ready"),
                "qps": [[at, 10.0 + d]], "latency_ms": [[at, 2.0]], "errors_per_s": [], "batch_sizes": {"1": 10},
                "generation": None,
            }
            for d in range(deployments)
        ],
        "replicas": replicas,
        "tenants": [
            {"tenant": f"tenant-{t}", "deployments": len(range(t, deployments, TENANTS)), "replicas": 0, "octants": 0}
            for t in range(min(TENANTS, deployments))
        ],
        "scheduler": {"decisions": {}, "mean_decision_ms": 0.3, "preemptions": 0, "defragmentation_moves": 0,
                      "pending": sum(1 for r in replicas if r["state"] == "pending")},
        "events": [{"at": at, "kind": "placed", "subject": "model-00-000", "message": "r01-n1 cards [0]"}],
    }  # fmt: skip


def _first_fit(free: list[list[int]], octants: int, start: int) -> tuple[int, int] | None:
    """The first card from node ``start`` on (wrapping round) with ``octants`` free; the last fifth stay empty
    unless the others are full."""
    for j in range(len(free)):
        i = (start + j) % len(free)
        if i == FAILED_NODE and len(free) > FAILED_NODE + 1:
            continue
        for g, left in enumerate(free[i]):
            if left >= octants:
                return i, g
    return None
