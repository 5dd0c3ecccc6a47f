"""The dashboard's JSON: one document with everything the page and ``octacloud top`` draw.

:func:`dashboard_state` joins the scheduler's allocations (the truth about who holds which card), the state
store's deployments, replicas and events, and the monitor's telemetry and history. Octants are laid out per
card in a fixed order (replicas sorted by deployment, then id; free octants last), so the same allocation always
draws the same map; each replica gets ``milli / 125`` cells on each of its cards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from octacloud.control.controller import Controller
from octacloud.control.deployments import Deployment, Replica, ReplicaState
from octacloud.core.domains import domain_dict
from octacloud.core.units import MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.observability.generation import GenerationFigures, figures
from octacloud.observability.monitor import CloudMonitor, Series
from octacloud.observability.telemetry import CPU_BUSY, CPU_CORES, CPU_MEMORY_USED, CardKey, FleetSample
from octacloud.scheduler.framework.state import Allocation, ClusterState

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


Status = list[tuple[Deployment, list[Replica]]]


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
    replicas = _replicas(status, sample)
    stats = controller.scheduling
    total = state.total_gpu_milli
    return {
        "at": monitor.clock.time(),
        "sample_at": sample.at if sample is not None else None,
        "fleet": {
            "nodes": _fleet(state, status, sample),
            "allocated_milli": state.allocated_gpu_milli,
            "total_milli": total,
            "allocation": state.allocated_gpu_milli / total if total else 0.0,
            "fragmentation": monitor.fragmentation.last,
        },
        "allocation": _points(monitor.allocation, since),
        "fragmentation": _points(monitor.fragmentation, since),
        "deployments": _deployments(status, monitor, sample, since),
        "replicas": replicas,
        "tenants": _tenants(state, status, usage),
        "scheduler": {
            "decisions": {o.value: n for o, n in stats.decisions.items()},
            "mean_decision_ms": stats.latency_sum_s * 1000 / stats.decision_count if stats.decision_count else None,
            "preemptions": stats.preemptions,
            "defragmentation_moves": stats.defragmentation_moves,
            "pending": sum(1 for r in replicas if r["state"] == "pending"),
        },
        "events": controller.store.events(events),
    }


def _fleet(state: ClusterState, status: Status, sample: FleetSample | None) -> list[dict[str, Any]]:
    """Nodes × cards × octants, from the scheduler's allocations (the truth about who holds what)."""
    replica_of = {r.id: (d, r) for d, rs in status for r in rs}

    def order(a: Allocation) -> tuple[str, str]:
        found = replica_of.get(a.request.name)
        return (found[0].spec.name if found else "", a.request.name)

    nodes = []
    for i, node in enumerate(state.nodes):
        cards = []
        for g in node.gpus:
            octants: list[dict[str, Any] | None] = []
            for a in sorted((a for a in state.on_node[i].values() if g.index in a.placement.gpus), key=order):
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
        nodes.append({"name": node.name, "health": node.health.value, "domains": domain_dict(node), "cards": cards})
    return nodes


def _deployments(
    status: Status, monitor: CloudMonitor, sample: FleetSample | None, since: float
) -> list[dict[str, Any]]:
    """Load as the gateway measured it, and the batch sizes the replicas executed (summed over replicas)."""
    telemetry = sample.replicas if sample is not None else {}
    out = []
    for d, rs in status:
        load = monitor.load.get(d.spec.name)
        batches: dict[int, int] = {}
        generation: GenerationFigures | None = None
        for r in rs:
            t = telemetry.get(r.id)
            if t is not None and t.serving is not None:
                for size, n in t.serving.batch_executions.items():
                    batches[size] = batches.get(size, 0) + n
                found = figures(t.serving.families)
                if found is not None:
                    generation = generation or GenerationFigures()
                    generation.add(found)
        out.append(
            {
                "name": d.spec.name,
                "model": d.spec.model,
                "tenant": d.spec.tenant,
                "priority": d.spec.priority,
                "octants": d.octants,
                "desired": d.replicas,
                "ready": sum(1 for r in rs if r.state is ReplicaState.READY),
                "qps": _points(load.qps, since) if load else [],
                "latency_ms": _points(load.latency_ms, since) if load else [],
                "errors_per_s": _points(load.errors_per_s, since) if load else [],
                "batch_sizes": {str(k): v for k, v in sorted(batches.items())},
                "generation": None
                if generation is None
                else {
                    **generation.as_dict(),
                    "tokens_per_s": _points(load.tokens_per_s, since) if load and load.tokens_per_s else [],
                },
            }
        )
    return out


def _replicas(status: Status, sample: FleetSample | None) -> list[dict[str, Any]]:
    telemetry = sample.replicas if sample is not None else {}
    out = []
    for d, rs in status:
        for r in rs:
            t = telemetry.get(r.id)
            out.append(
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
    return out


def _tenants(state: ClusterState, status: Status, usage: UsageSource | None) -> list[dict[str, Any]]:
    """What each tenant holds now, and (with the ledger) what it was metered for."""
    tenants: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return tenants.setdefault(name, {"tenant": name, "deployments": 0, "replicas": 0, "octants": 0})

    for d, rs in status:
        e = entry(d.spec.tenant)
        e["deployments"] += 1
        for r in rs:
            if r.id in state.allocations:
                p = state.allocations[r.id].placement
                e["replicas"] += 1
                e["octants"] += round(p.milli_per_gpu * len(p.gpus) / MILLI_PER_OCTANT)
    for row in usage() if usage is not None else ():
        entry(str(row["tenant"]))["usage"] = {k: v for k, v in row.items() if k != "tenant"}
    return [tenants[name] for name in sorted(tenants)]
