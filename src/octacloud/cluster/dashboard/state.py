"""The dashboard's JSON: one document with everything the page and ``octacloud top`` draw.

:func:`dashboard_state` joins the scheduler's allocations (the truth about who holds which card), the state
store's deployments, replicas and events, and the monitor's telemetry and history. Octants are laid out per
card in a fixed order (replicas sorted by deployment, then id; free octants last), so the same allocation always
draws the same map; each replica gets ``milli / 125`` cells on each of its cards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from octacloud.cluster.controller import Controller
from octacloud.core.units import MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.observability.monitor import CloudMonitor, Series
from octacloud.observability.telemetry import CPU_BUSY, CPU_CORES, CPU_MEMORY_USED, CardKey, FleetSample

UsageSource = Callable[[], Sequence[Mapping[str, Any]]]
"""Per-tenant usage totals from the metering ledger (``[{"tenant": ..., <metric>: <total>, ...}]``)."""


def _points(series: Series, since: float) -> list[list[float]]:
    return [[round(t, 3), round(v, 6)] for t, v in series.points if t > since]


def _card_telemetry(sample: FleetSample | None, node: str, gpu: int) -> dict[str, Any]:
    card = sample.cards.get(CardKey(node, gpu)) if sample is not None else None
    if card is None:
        return {}
    v = card.values
    if card.source == "nvml":
        return {
            "source": "nvml",
            "utilisation": v.get("DCGM_FI_DEV_GPU_UTIL", 0.0) / 100,
            "memory_used_mib": v.get("DCGM_FI_DEV_FB_USED"),
            "memory_free_mib": v.get("DCGM_FI_DEV_FB_FREE"),
            "power_w": v.get("DCGM_FI_DEV_POWER_USAGE"),
            "temperature_c": v.get("DCGM_FI_DEV_GPU_TEMP"),
        }
    return {
        "source": "replicas",
        "utilisation": v.get(CPU_BUSY),
        "cpu": v.get(CPU_CORES),
        "memory_used_mib": v[CPU_MEMORY_USED] / (1024 * 1024) if CPU_MEMORY_USED in v else None,
    }


def dashboard_state(
    controller: Controller,
    monitor: CloudMonitor,
    *,
    since: float = 0.0,
    events: int = 50,
    usage: UsageSource | None = None,
) -> dict[str, Any]:
    """Everything the dashboard shows; time series only after ``since`` (wall-clock seconds)."""
    state = controller.scheduler.state
    sample = monitor.latest
    status = controller.status()
    replica_of = {r.id: (d, r) for d, rs in status for r in rs}
    telemetry = sample.replicas if sample is not None else {}

    nodes = []
    for i, node in enumerate(state.nodes):
        cards = []
        for g in node.gpus:
            holders = sorted(
                (a for a in state.on_node[i].values() if g.index in a.placement.gpus),
                key=lambda a: (
                    replica_of[a.request.name][0].spec.name if a.request.name in replica_of else "",
                    a.request.name,
                ),
            )
            octants: list[dict[str, Any] | None] = []
            for a in holders:
                d, r = replica_of.get(a.request.name, (None, None))
                cell = {
                    "replica": a.request.name,
                    "deployment": d.spec.name if d is not None else "",
                    "tenant": d.spec.tenant if d is not None else a.request.owner,
                    "state": r.state.value if r is not None else "unknown",
                }
                octants.extend([cell] * round(a.placement.milli_per_gpu / MILLI_PER_OCTANT))
            octants.extend([None] * max(0, OCTANTS_PER_GPU - len(octants)))
            cards.append(
                {
                    "index": g.index,
                    "model": g.model,
                    "memory_mib": g.memory_mib,
                    "health": g.health.value,
                    "usable": state.card_usable(i, g.index),
                    "free_milli": state.free_gpu[i][g.index],
                    "octants": octants,
                    "telemetry": _card_telemetry(sample, node.name, g.index),
                }
            )
        nodes.append({"name": node.name, "health": node.health.value, "cards": cards})

    deployments = []
    for d, rs in status:
        load = monitor.load.get(d.spec.name)
        batches: dict[int, int] = {}
        for r in rs:
            t = telemetry.get(r.id)
            if t is not None and t.serving is not None:
                for size, n in t.serving.batch_executions.items():
                    batches[size] = batches.get(size, 0) + n
        deployments.append(
            {
                "name": d.spec.name,
                "model": d.spec.model,
                "tenant": d.spec.tenant,
                "priority": d.spec.priority,
                "octants": d.octants,
                "desired": d.replicas,
                "ready": sum(1 for r in rs if r.state.value == "ready"),
                "qps": _points(load.qps, since) if load else [],
                "latency_ms": _points(load.latency_ms, since) if load else [],
                "errors_per_s": _points(load.errors_per_s, since) if load else [],
                "batch_sizes": {str(k): v for k, v in sorted(batches.items())},
            }
        )

    replicas = []
    for d, rs in status:
        for r in rs:
            t = telemetry.get(r.id)
            replicas.append(
                {
                    "id": r.id,
                    "deployment": d.spec.name,
                    "tenant": d.spec.tenant,
                    "state": r.state.value,
                    "node": r.node,
                    "gpus": list(r.gpus),
                    "milli_per_gpu": r.milli_per_gpu,
                    "restarts": r.restarts,
                    "message": r.message,
                    "busy": t.busy_ratio if t is not None else None,
                    "cpu_cores": t.cpu_cores if t is not None else None,
                    "rss_bytes": t.rss_bytes if t is not None else None,
                }
            )

    tenants: dict[str, dict[str, Any]] = {}
    for d, rs in status:
        entry = tenants.setdefault(
            d.spec.tenant, {"tenant": d.spec.tenant, "deployments": 0, "replicas": 0, "octants": 0}
        )
        entry["deployments"] += 1
        for r in rs:
            if r.id in state.allocations:
                entry["replicas"] += 1
                p = state.allocations[r.id].placement
                entry["octants"] += round(p.milli_per_gpu * len(p.gpus) / MILLI_PER_OCTANT)
    if usage is not None:
        for row in usage():
            entry = tenants.setdefault(
                str(row["tenant"]), {"tenant": row["tenant"], "deployments": 0, "replicas": 0, "octants": 0}
            )
            entry["usage"] = {k: v for k, v in row.items() if k != "tenant"}

    stats = controller.scheduling
    total = state.total_gpu_milli
    return {
        "at": monitor.clock.time(),
        "sample_at": sample.at if sample is not None else None,
        "fleet": {
            "nodes": nodes,
            "allocated_milli": state.allocated_gpu_milli,
            "total_milli": total,
            "allocation": state.allocated_gpu_milli / total if total else 0.0,
            "fragmentation": monitor.fragmentation.last,
        },
        "allocation": _points(monitor.allocation, since),
        "fragmentation": _points(monitor.fragmentation, since),
        "deployments": deployments,
        "replicas": replicas,
        "tenants": sorted(tenants.values(), key=lambda t: str(t["tenant"])),
        "scheduler": {
            "decisions": {o.value: n for o, n in stats.decisions.items()},
            "mean_decision_ms": stats.latency_sum_s * 1000 / stats.decision_count if stats.decision_count else None,
            "preemptions": stats.preemptions,
            "defragmentation_moves": stats.defragmentation_moves,
            "pending": sum(1 for r in replicas if r["state"] == "pending"),
        },
        "events": controller.store.events(events),
    }
