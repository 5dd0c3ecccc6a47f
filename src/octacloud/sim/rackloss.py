"""Losing a rack at fleet scale: fill the fleet as the published protocol does, then lose each rack in turn.

One run (:func:`run_rack_loss`, a pure function of its :class:`RackLossSpec`): read the fleet, give it racks with
the seeded generator of :mod:`octacloud.sim.domains` unless its node file declares them, inflate and shuffle the
trace with the seed (:func:`octacloud.sim.protocol.inflate`), place the pods one by one with the policy (no
departures), then, for every rack that holds work, release everything on it and re-place it on the other racks
with the same policy as failover work (:func:`octacloud.scheduler.actions.evacuate.evacuate`, rolled back after
each rack, so each rack is lost alone from the same full fleet). The result is the allocation the policy reached
and the share of the lost GPU demand it could not re-place: over all racks (each rack as likely to fail), and for
the worst rack.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from octacloud.core.domains import declared, group_by_domain
from octacloud.core.model import Node
from octacloud.scheduler.actions.evacuate import evacuate
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from octacloud.sim.domains import DomainSpec, assign_domains
from octacloud.sim.protocol import inflate
from octacloud.sim.traces import read_gpu_memory_table, read_nodes, read_pods


@dataclass(frozen=True, slots=True)
class RackLossSpec:
    nodes: Path
    pods: Path
    policy: str
    seed: int
    racks: DomainSpec = field(default_factory=DomainSpec)
    tune: float = 1.3
    gpu_memory: Path | None = None


@dataclass(frozen=True, slots=True)
class RackLossResult:
    spec: RackLossSpec
    racks: int
    """Racks that held work when the fill ended (each is lost in turn)."""
    allocation: float
    """Allocated share of the fleet's GPU when the fill ended, 0..1."""
    lost_gpu_milli: int
    """GPU demand on the lost racks, summed over racks."""
    unplaced_gpu_milli: int
    """Of it, what could not be re-placed."""
    worst_rack_share: float
    uncovered_racks: int
    """Racks whose work could not all be re-placed."""
    seconds: float

    @property
    def unplaced_share(self) -> float:
        return self.unplaced_gpu_milli / self.lost_gpu_milli if self.lost_gpu_milli else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": str(self.spec.nodes),
            "pods": str(self.spec.pods),
            "policy": self.spec.policy,
            "seed": self.spec.seed,
            "racks_spec": str(self.spec.racks),
            "tune": self.spec.tune,
            "racks": self.racks,
            "allocation_pct": round(100 * self.allocation, 3),
            "lost_gpu_milli": self.lost_gpu_milli,
            "unplaced_gpu_milli": self.unplaced_gpu_milli,
            "unplaced_pct": round(100 * self.unplaced_share, 3),
            "worst_rack_unplaced_pct": round(100 * self.worst_rack_share, 3),
            "uncovered_racks": self.uncovered_racks,
            "seconds": round(self.seconds, 1),
        }


def fleet_with_racks(nodes: Sequence[Node], spec: DomainSpec, seed: int) -> list[Node]:
    """``nodes`` as their file declares them when any declares a rack, else with racks drawn with ``seed``."""
    if any(declared(n, "rack") for n in nodes):
        return list(nodes)
    return assign_domains(nodes, spec, seed=seed)


def run_rack_loss(spec: RackLossSpec) -> RackLossResult:
    started = time.perf_counter()
    table = None if spec.gpu_memory is None else read_gpu_memory_table(spec.gpu_memory)
    nodes = fleet_with_racks(read_nodes(spec.nodes, gpu_memory=table), spec.racks, spec.seed)
    original = [p.request for p in read_pods(spec.pods)]
    state = ClusterState(nodes)
    workload = TargetWorkload.from_requests(original)
    scheduler = Scheduler(state, build_profile(spec.policy, seed=spec.seed, workload=workload))
    for request in inflate(original, seed=spec.seed, tune=spec.tune, capacity_milli=state.total_gpu_milli):
        scheduler.schedule(request)
    allocation = state.utilisation()
    return evaluate_rack_loss(spec, scheduler, allocation, started)


def evaluate_rack_loss(spec: RackLossSpec, scheduler: Scheduler, allocation: float, started: float) -> RackLossResult:
    """Lose each rack of ``scheduler``'s state that holds work, alone, and count what could not be re-placed."""
    state = scheduler.state
    lost = unplaced = uncovered = racks = 0
    worst = 0.0
    for name, members in group_by_domain(state.nodes, "rack").items():
        if not any(state.on_node[i] for i in members):
            continue
        e = evacuate(scheduler, members, kind="rack", domain=name)
        racks += 1
        lost += e.lost_gpu_milli
        unplaced += e.unplaced_gpu_milli
        uncovered += not e.covered
        worst = max(worst, e.unplaced_share)
    return RackLossResult(spec, racks, allocation, lost, unplaced, worst, uncovered, time.perf_counter() - started)
