"""Scheduler decision latency on the real openb fleet, and a quick check of the published FGD reproduction.

Latency (default): for each policy, the 1,213-node openb fleet is filled with trace pods (the published
protocol's shuffled, inflated default trace) by that policy up to ``--fill`` of GPU capacity; then the next
``--decisions`` pods are scheduled one by one and each decision is timed (``time.perf_counter`` around
``Scheduler.schedule``). Prints p50 / p99 / max per policy, measured in this one run, single-threaded, next to the
same decisions taken by the exhaustive runner (``Scheduler(indexed=False)``, every node visited) on the same state,
which must agree.

Reproduction (``--reproduce``): runs the published protocol end to end for the given policies, seeds and trace
families and prints our unallocated GPU % at arrived 100 % next to the authors' published values.

    .venv/bin/python bench/scheduler_decisions.py
    .venv/bin/python bench/scheduler_decisions.py --reproduce --families default,gpushare40,multigpu30 --seeds 42,43
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from octacloud.core import Request
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import ClusterState, Decision, Scheduler
from octacloud.scheduler.policies import POLICY_IDS, build_profile
from octacloud.sim.protocol import inflate, replay
from octacloud.sim.traces import read_nodes, read_pods

NODE_FILE = "openb_node_list_gpu_node.csv"


def traces_dir() -> Path:
    env = os.environ.get("OCTACLOUD_TRACES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(folder: Path, policies: list[str], fill: float, decisions: int, seed: int) -> None:
    nodes = read_nodes(folder / NODE_FILE)
    pods = [p.request for p in read_pods(folder / "openb_pod_list_default.csv")]
    workload = TargetWorkload.from_requests(pods)
    capacity = sum(n.gpu_milli for n in nodes)
    requests = inflate(pods, seed=seed, tune=1.3, capacity_milli=capacity)
    print(
        f"fleet: {len(nodes)} nodes, {capacity // 1000} GPUs; "
        f"fill to {fill:.0%} of GPU, then time {decisions} decisions, indexed and exhaustive on the same state"
    )
    print(
        "wall: perf_counter (includes time the OS gave to other processes); cpu: thread_time (this thread on its core)"
    )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(
        f"{'policy':<16} {'filled %':>8} {'wall p50':>9} {'wall p99':>9} {'cpu p50':>8} {'cpu p99':>8} "
        f"{'cpu max':>8} {'placed':>7} {'exh. p50':>9} {'exh. p99':>9} {'ratio':>6}   (ms; cpu; ratio of cpu sums)"
    )
    for policy in policies:
        state = ClusterState(nodes)
        scheduler = Scheduler(state, build_profile(policy, seed=seed, workload=workload))
        exhaustive = Scheduler(state, build_profile(policy, seed=seed, workload=workload), indexed=False)
        k = 0
        while k < len(requests) and state.allocated_gpu_milli < fill * capacity:
            scheduler.schedule(requests[k])
            k += 1
        filled = state.utilisation()
        wall: list[float] = []
        cpu: list[float] = []
        slow: list[float] = []
        placed = 0
        clock, cpu_clock = time.perf_counter, time.thread_time
        for r in requests[k : k + decisions]:
            cpu_start = cpu_clock()
            reference = exhaustive.decide(r)
            slow.append(cpu_clock() - cpu_start)
            start, cpu_start = clock(), cpu_clock()
            decision = scheduler.schedule(r)
            cpu.append(cpu_clock() - cpu_start)
            wall.append(clock() - start)
            if (decision.placement, decision.score) != (reference.placement, reference.score):
                raise SystemExit(f"{policy}: indexed {decision.explain()} ≠ exhaustive {reference.explain()}")
            placed += decision.placed
        print(
            f"{policy:<16} {100 * filled:>8.1f} "
            f"{1e3 * percentile(wall, 0.5):>9.3f} {1e3 * percentile(wall, 0.99):>9.3f} "
            f"{1e3 * percentile(cpu, 0.5):>8.3f} {1e3 * percentile(cpu, 0.99):>8.3f} {1e3 * max(cpu):>8.3f} "
            f"{placed:>7} {1e3 * percentile(slow, 0.5):>9.3f} {1e3 * percentile(slow, 0.99):>9.3f} "
            f"{sum(slow) / max(sum(cpu), 1e-9):>6.1f}",
            flush=True,
        )


def published(folder: Path) -> dict[tuple[str, str], dict[int, float]]:
    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    with (folder / "fgd_published_alloc.csv").open() as handle:
        for row in csv.DictReader(handle):
            out[(row["workload"], row["sc_policy"])][int(row["seed"])] = 100 - float(row["100"])
    return out


def unallocated_at_full(scheduler: Scheduler, requests: list[Request], capacity: int) -> float:
    """Unallocated GPU % when the arrived GPU request first reaches 100 % of capacity."""
    arrived = 0
    result: list[float] = []

    def on_pod(_index: int, request: Request, _decision: Decision, _seconds: float) -> None:
        nonlocal arrived
        arrived += request.total_gpu_milli
        if not result and arrived >= capacity:
            result.append(100 - 100 * scheduler.state.allocated_gpu_milli / capacity)

    replay(scheduler, requests, on_pod)
    return result[0] if result else 100 - 100 * scheduler.state.allocated_gpu_milli / capacity


def reproduce(folder: Path, families: list[str], policies: list[str], seeds: list[int]) -> None:
    nodes = read_nodes(folder / NODE_FILE)
    capacity = sum(n.gpu_milli for n in nodes)
    reference = published(folder)
    print(f"{'workload':<12} {'policy':<12} {'ours (seeds)':<28} {'ours':>6} {'pub.':>6} {'diff':>6} {'s/run':>6}")
    for family in families:
        pods = [p.request for p in read_pods(folder / f"openb_pod_list_{family}.csv")]
        workload = TargetWorkload.from_requests(pods)
        for policy in policies:
            ours: list[float] = []
            seconds: list[float] = []
            for seed in seeds:
                requests = inflate(pods, seed=seed, tune=1.3, capacity_milli=capacity)
                scheduler = Scheduler(ClusterState(nodes), build_profile(policy, seed=seed, workload=workload))
                start = time.perf_counter()
                ours.append(unallocated_at_full(scheduler, requests, capacity))
                seconds.append(time.perf_counter() - start)
            pub = reference.get((f"openb_pod_list_{family}", POLICY_IDS[policy]), {})
            pub_mean = statistics.mean(pub.values()) if pub else float("nan")
            mean = statistics.mean(ours)
            shown = " ".join(f"{v:.2f}" for v in ours)
            print(
                f"{family:<12} {policy:<12} {shown:<28} {mean:>6.2f} {pub_mean:>6.2f} {mean - pub_mean:>+6.2f} "
                f"{statistics.mean(seconds):>6.1f}",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=traces_dir())
    parser.add_argument("--policies", default=",".join(POLICY_IDS))
    parser.add_argument("--fill", type=float, default=0.6, help="GPU share filled before timing (default 0.6)")
    parser.add_argument("--decisions", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--reproduce", action="store_true", help="run the published protocol instead")
    parser.add_argument("--families", default="default")
    parser.add_argument("--seeds", default="42,43")
    args = parser.parse_args()
    if not (args.traces / NODE_FILE).exists():
        print(f"openb traces not found in {args.traces} (set OCTACLOUD_TRACES or --traces)", file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    if args.reproduce:
        reproduce(args.traces, args.families.split(","), policies, [int(s) for s in args.seeds.split(",")])
    else:
        latency(args.traces, policies, args.fill, args.decisions, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
