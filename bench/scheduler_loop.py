"""One full pass of the re-evaluation loop at fleet scale: the 6,212-GPU openb fleet and the fleet replicated.

The openb fleet (1,213 nodes, 6,212 GPUs) is filled with the default trace's pods (shuffled and inflated as the
published protocol does) by the given policy up to ``--fill`` of GPU capacity; the next ``--pending`` pods become
the pending queue. For the large fleet the filled fleet is replicated ``--copies`` times (node and request names
suffixed), which keeps the same realistic, policy-made fragmentation without placing tens of thousands of pods.
Then :meth:`ReevaluationLoop.run_pass` runs once per fleet (place the pending queue, preempt, defragment within
``--moves`` moves) and the wall time is printed with what the pass did, single-threaded.

    .venv/bin/python bench/scheduler_loop.py
    .venv/bin/python bench/scheduler_loop.py --copies 8 --fill 0.97 --pending 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from octacloud.core import Node, Placement, Request
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.scheduler.policies import build_profile
from octacloud.sim.protocol import inflate
from octacloud.sim.traces import read_nodes, read_pods


def traces_dir() -> Path:
    env = os.environ.get("OCTACLOUD_TRACES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"


def fill(
    nodes: list[Node], pods: list[Request], workload: TargetWorkload, *, policy: str, seed: int, share: float
) -> tuple[ClusterState, list[Request]]:
    """The fleet filled by ``policy`` up to ``share`` of GPU capacity, and the pods not yet offered."""
    state = ClusterState(nodes)
    scheduler = Scheduler(state, build_profile(policy, seed=seed, workload=workload))
    requests = inflate(pods, seed=seed, tune=1.3, capacity_milli=state.total_gpu_milli)
    target = share * state.total_gpu_milli
    for k, request in enumerate(requests):
        if state.allocated_gpu_milli >= target:
            return state, requests[k:]
        scheduler.schedule(request)
    return state, []


def replicate(state: ClusterState, copies: int) -> ClusterState:
    """``copies`` copies of ``state``'s fleet with the same allocations (names suffixed ``~k``)."""
    nodes = [replace(n, name=f"{n.name}~{k}") for k in range(copies) for n in state.nodes]
    big = ClusterState(nodes)
    for k in range(copies):
        for a in state:
            request = replace(a.request, name=f"{a.request.name}~{k}")
            p = a.placement
            big.allocate(request, Placement(request.name, f"{p.node}~{k}", p.gpus, p.milli_per_gpu))
    return big


def one_pass(
    label: str, state: ClusterState, pending: list[Request], args: argparse.Namespace, w: TargetWorkload
) -> None:
    scheduler = Scheduler(state, build_profile(args.policy, seed=args.seed, workload=w))
    loop = ReevaluationLoop(scheduler, LoopSettings(moves_per_pass=args.moves))
    gpus = sum(n.gpu_count for n in state.nodes)
    before = 100.0 * state.utilisation()
    started = time.perf_counter()
    report = loop.run_pass(0.0, pending)
    seconds = time.perf_counter() - started
    print(
        f"{label}: {len(state)} nodes, {gpus} GPUs, {before:.1f} % allocated, {len(pending)} pending → "
        f"pass {seconds * 1000:.0f} ms: placed {len(report.placed)}, moves {len(report.moves)}, "
        f"still pending {len(report.pending)}, allocated {100.0 * state.utilisation():.1f} %, "
        f"{seconds / max(len(pending), 1) * 1000:.2f} ms per pending request"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="octacloud")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fill", type=float, default=0.95, help="share of GPU capacity filled before the pass")
    parser.add_argument("--pending", type=int, default=200, help="pods pending when the pass starts")
    parser.add_argument("--moves", type=int, default=16, help="defragmentation moves per pass")
    parser.add_argument("--copies", type=int, default=8, help="fleet copies for the large fleet (8: 49,696 GPUs)")
    args = parser.parse_args(argv)
    folder = traces_dir()
    if not folder.is_dir():
        print(f"no openb traces in {folder} (set OCTACLOUD_TRACES)", file=sys.stderr)
        return 2
    nodes = list(read_nodes(folder / "openb_node_list_gpu_node.csv"))
    pods = [p.request for p in read_pods(folder / "openb_pod_list_default.csv")]
    workload = TargetWorkload.from_requests(pods)
    started = time.perf_counter()
    state, rest = fill(nodes, pods, workload, policy=args.policy, seed=args.seed, share=args.fill)
    print(f"filled the openb fleet to {100.0 * state.utilisation():.1f} % in {time.perf_counter() - started:.1f} s")
    big = replicate(state, args.copies)
    pending = rest[: args.pending]
    one_pass("openb fleet", state, pending, args, workload)
    big_pending = [replace(r, name=f"{r.name}~{k}") for k in range(args.copies) for r in pending]
    one_pass(f"openb fleet ×{args.copies}", big, big_pending, args, workload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
