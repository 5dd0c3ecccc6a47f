"""One full pass of the re-evaluation loop at fleet scale, indexed and exhaustive, side by side.

The openb fleet (1,213 nodes, 6,212 GPUs) is filled with the default trace's pods (shuffled and inflated as the
published protocol does) by the given policy up to ``--fill`` of GPU capacity; the next pods become the pending
queue. The large fleets are the filled fleet replicated ``--copies`` times (node and request names suffixed), which
keeps the same realistic, policy-made fragmentation without placing hundreds of thousands of pods; each copy gets
the same pending pods, so the queue grows with the fleet (``--pending`` is the queue of the largest fleet).

For each fleet, :meth:`ReevaluationLoop.run_pass` runs once (place the pending queue, preempt, defragment within
``--moves`` moves) with the runner deciding over node classes (the default) and once visiting every node
(``Scheduler(indexed=False)``), each on its own copy of the fleet, single-threaded. The placements and moves of the
two passes are compared (they must be identical) and the pass times printed with their ratio, as wall time and as
this thread's CPU time, with the machine's load average (on a shared machine wall time includes time given to other
processes). Every ``decide`` call of the pass is timed (CPU): decisions per second, p50 and p99.

    .venv/bin/python bench/scheduler_loop.py                      # 6,212, 49,696 and 105,604 GPUs
    .venv/bin/python bench/scheduler_loop.py --exhaustive-up-to 8  # skip the exhaustive pass at 105,604 (~30 s CPU)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from octacloud.core import Node, Placement, Request
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import ClusterState, Decision, Profile, Scheduler
from octacloud.scheduler.loop import LoopSettings, PassReport, ReevaluationLoop
from octacloud.scheduler.policies import build_profile
from octacloud.sim.protocol import inflate
from octacloud.sim.traces import read_nodes, read_pods
from record import Recorder, add_flag


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


class TimedScheduler(Scheduler):
    """A scheduler that records the CPU time of every decision (``decide``: also those of preempt/defragment)."""

    def __init__(self, state: ClusterState, profile: Profile, *, indexed: bool) -> None:
        super().__init__(state, profile, indexed=indexed)
        self.times: list[float] = []

    def decide(
        self, request: Request, nodes: Sequence[int] | None = None, *, exclude: Collection[int] = ()
    ) -> Decision:
        started = time.thread_time()
        try:
            return super().decide(request, nodes, exclude=exclude)
        finally:
            self.times.append(time.thread_time() - started)


@dataclass(slots=True)
class PassResult:
    wall: float
    cpu: float
    report: PassReport
    decisions: list[float]
    allocated: float


def one_pass(
    state: ClusterState, pending: list[Request], args: argparse.Namespace, w: TargetWorkload, *, indexed: bool
) -> PassResult:
    scheduler = TimedScheduler(state, build_profile(args.policy, seed=args.seed, workload=w), indexed=indexed)
    loop = ReevaluationLoop(scheduler, LoopSettings(moves_per_pass=args.moves))
    if indexed:
        scheduler.classes()  # built once per scheduler and kept current by the state: not part of a pass
    gc.collect()
    wall, cpu = time.perf_counter(), time.thread_time()
    report = loop.run_pass(0.0, pending)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return PassResult(wall, cpu, report, scheduler.times, state.utilisation())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def outcome(report: PassReport) -> tuple[object, ...]:
    return (sorted(report.placed.items()), report.moves, [r.name for r in report.pending], report.preempted)


def show(label: str, r: PassResult) -> str:
    d = r.decisions
    return (
        f"  {label:<10} pass {r.wall * 1000:>7.0f} ms wall {r.cpu * 1000:>7.0f} ms cpu; {len(d)} decisions, "
        f"{len(d) / max(r.cpu, 1e-9):.0f}/s cpu, p50 {percentile(d, 0.5) * 1000:.3f} ms, "
        f"p99 {percentile(d, 0.99) * 1000:.3f} ms, max {max(d, default=0.0) * 1000:.3f} ms (cpu)"
    )


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="octacloud")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fill", type=float, default=0.95, help="share of GPU capacity filled before the pass")
    parser.add_argument("--pending", type=int, default=3000, help="pods pending at the largest fleet")
    parser.add_argument("--moves", type=int, default=16, help="defragmentation moves per pass")
    parser.add_argument("--copies", default="1,8,17", help="fleet copies (1: 6,212 GPUs, 8: 49,696, 17: 105,604)")
    parser.add_argument("--exhaustive-up-to", type=int, default=17, help="exhaustive passes up to this many copies")
    add_flag(parser)
    args = parser.parse_args(argv)
    recorder = Recorder("scheduler_loop", None if argv is None else [sys.argv[0], *argv])
    figures: list[dict[str, object]] = []
    folder = traces_dir()
    if not folder.is_dir():
        print(f"no openb traces in {folder} (set OCTACLOUD_TRACES)", file=sys.stderr)
        return 2
    copies = sorted({int(c) for c in args.copies.split(",") if c})
    nodes = list(read_nodes(folder / "openb_node_list_gpu_node.csv"))
    pods = [p.request for p in read_pods(folder / "openb_pod_list_default.csv")]
    workload = TargetWorkload.from_requests(pods)
    started = time.perf_counter()
    state, rest = fill(nodes, pods, workload, policy=args.policy, seed=args.seed, share=args.fill)
    print(f"filled the openb fleet to {100.0 * state.utilisation():.1f} % in {time.perf_counter() - started:.1f} s")
    per_copy = rest[: -(-args.pending // max(copies))]
    print(f"policy {args.policy}; {len(per_copy)} pending pods per copy; load average {load()} at start")
    for c in copies:
        pending = [replace(r, name=f"{r.name}~{k}") for k in range(c) for r in per_copy][: args.pending]
        gpus = sum(n.gpu_count for n in state.nodes) * c
        print(
            f"openb fleet ×{c}: {len(state) * c} nodes, {gpus} GPUs, {100.0 * state.utilisation():.1f} % allocated, "
            f"{len(pending)} pending",
            flush=True,
        )
        fast = one_pass(replicate(state, c), pending, args, workload, indexed=True)
        print(show("indexed", fast) + f"; placed {len(fast.report.placed)}, moves {len(fast.report.moves)}", flush=True)
        figures.append({"copies": c, "nodes": len(state) * c, "gpus": gpus, "pending": len(pending),
                        "indexed": {"wall_s": fast.wall, "cpu_s": fast.cpu, "placed": len(fast.report.placed),
                                    "moves": len(fast.report.moves)}})  # fmt: skip
        if c > args.exhaustive_up_to:
            print(f"  (no exhaustive pass above {args.exhaustive_up_to} copies); load average {load()}", flush=True)
            continue
        slow = one_pass(replicate(state, c), pending, args, workload, indexed=False)
        same = outcome(fast.report) == outcome(slow.report) and fast.allocated == slow.allocated
        print(show("exhaustive", slow), flush=True)
        figures[-1]["exhaustive"] = {"wall_s": slow.wall, "cpu_s": slow.cpu, "identical": same}
        print(
            f"  exhaustive / indexed: {slow.wall / fast.wall:.1f}× wall, {slow.cpu / fast.cpu:.1f}× cpu; "
            f"identical placements and moves: {'yes' if same else 'NO'}; load average {load()}",
            flush=True,
        )
        if not same:
            recorder.save(figures)
            return 1
    recorder.save(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
