"""Why a policy allocates what it does in churn: the fleet's shape over the window, and where it decides unlike FGD.

One churn run (Poisson arrivals of the trace's shapes, exponential lifetimes, the loop's queue, no defragmentation:
what ``octacloud simulate --arrivals ... --queue`` runs) with two probes:

* every pass inside the window samples the fleet: whole free cards, nodes with at least 2 / 4 / 8 whole free
  cards, free GPU in partly used cards (below 200 milli-GPU and 200-999), what of each request class waits;
* every arrival inside the window is also decided (not committed) by ``--shadow`` on the same state; for one-card
  requests and shares the probe counts the decisions where the policy takes a node with at least ``--big`` whole
  free cards and the shadow does not, and prints the first ``--show`` of them with octacloud's terms on both
  nodes: ``dF`` (fragmentation), ``dS`` (stranding), ``M`` (multi-card scarcity), whole cards, CPU left; for
  shares the two put on different cards, what each leaves on its card (below 200 milli-GPU, or 200-999).

    .venv/bin/python bench/churn_diagnosis.py --nodes FLEET.csv --pods TRACE.csv --policy octacloud --rate 3.13
"""

from __future__ import annotations

import argparse
import collections
import statistics
from pathlib import Path

from octacloud.core import MILLI_PER_GPU, Request
from octacloud.core.clock import ManualClock
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import ClusterState, Decision, Scheduler
from octacloud.scheduler.loop import LoopSettings, ReevaluationLoop
from octacloud.scheduler.plugins.octacloud import ConsolidatingFragmentation
from octacloud.scheduler.policies import build_profile
from octacloud.sim.churn import ChurnSimulation
from octacloud.sim.reevaluate import LoopHook
from octacloud.sim.synthetic import parse_arrivals, parse_lifetime, synthetic_arrivals
from octacloud.sim.traces import read_nodes, read_pods


def kind(r: Request) -> str:
    if r.num_gpu == 0:
        return "cpu"
    if r.num_gpu > 1:
        return "multi"
    return "share" if r.is_sharing else "one"


def whole(state: ClusterState, i: int) -> int:
    return sum(1 for f in state.signature[i].free_gpu if f >= MILLI_PER_GPU)


def terms(meter: ConsolidatingFragmentation, state: ClusterState, r: Request, i: int) -> str:
    """octacloud's ΔF, ΔS and M for ``r`` on node ``i`` (whole cards: the first free ones; a share: the fullest
    card it fits, which is where the terms differ least)."""
    model, cpu, memory, free = state.signature[i]
    after = list(free)
    if r.is_sharing:
        g = min((k for k, f in enumerate(free) if f >= r.gpu_milli), key=lambda k: free[k])
        after[g] -= r.gpu_milli
    else:
        for g in [k for k, f in enumerate(free) if f >= MILLI_PER_GPU][: r.num_gpu]:
            after[g] = 0
    frag = meter.model.fragmentation
    d_f = frag(model, cpu - r.cpu_milli, after) - frag(model, cpu, free)
    d_s = meter.stranded(model, cpu - r.cpu_milli, after, memory - r.memory_mib) - meter.stranded(
        model, cpu, free, memory
    )
    costs = meter.whole_card_costs(state)
    changed = state.signature[i]._replace(
        free_cpu=cpu - r.cpu_milli, free_memory=memory - r.memory_mib, free_gpu=tuple(after)
    )
    lost = [b - c for b, c in zip(meter.copies(state.signature[i]), meter.copies(changed), strict=True)]
    m = sum(n * c for n, c in zip(lost, costs, strict=True)) if costs else 0.0
    return f"dF {d_f:7.1f}  dS {d_s:7.1f}  M {m:6.1f}  whole {whole(state, i)}  cpu left {cpu / 1000:5.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=Path, required=True)
    ap.add_argument("--pods", type=Path, required=True)
    ap.add_argument("--policy", default="octacloud")
    ap.add_argument("--shadow", default="fgd")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--rate", type=float, required=True, help="Poisson arrivals per second")
    ap.add_argument("--lifetime", default="exponential:600")
    ap.add_argument("--duration", type=float, default=3000.0)
    ap.add_argument("--warmup", type=float, default=1500.0)
    ap.add_argument("--big", type=int, default=4, help="whole free cards that make a node 'big'")
    ap.add_argument("--show", type=int, default=0, help="print this many big-node decisions with their terms")
    a = ap.parse_args()

    nodes, shapes = tuple(read_nodes(a.nodes)), tuple(p.request for p in read_pods(a.pods))
    state = ClusterState(nodes)
    workload = TargetWorkload.from_requests(shapes)
    scheduler = Scheduler(state, build_profile(a.policy, seed=a.seed, workload=workload))
    shadow = Scheduler(state, build_profile(a.shadow, seed=a.seed, workload=workload))
    meter = ConsolidatingFragmentation(workload, churn_aware=False)
    loop = ReevaluationLoop(scheduler, LoopSettings(period=5.0, defragment=False))
    hook = LoopHook(loop)
    samples: dict[str, list[float]] = collections.defaultdict(list)
    counts: collections.Counter[str] = collections.Counter()
    shown = 0

    def sample(sim: ChurnSimulation) -> None:
        if sim.now < a.warmup:
            return
        per_node = [whole(state, i) for i in range(len(state))]
        partial = [f for sig in state.signature for f in sig.free_gpu if 0 < f < MILLI_PER_GPU]
        samples["whole free cards"].append(sum(per_node))
        for k in (2, 4, 8):
            samples[f"nodes with >= {k} whole free cards"].append(sum(1 for w in per_node if w >= k))
        samples["free GPU in partly used cards < 200, cards"].append(sum(f for f in partial if f < 200) / 1000)
        samples["free GPU in partly used cards 200-999, cards"].append(sum(f for f in partial if f >= 200) / 1000)
        waiting: collections.Counter[str] = collections.Counter()
        for item in sim.pending:
            waiting[kind(item.request)] += item.request.total_gpu_milli / 1000
        # whole free cards that no waiting GPU request can use because the node's CPU or memory is spent
        gpu_waiting = [item.request for item in sim.pending if item.request.num_gpu == 1]
        stranded = 0
        for sig in state.signature:
            cards = sum(1 for f in sig.free_gpu if f >= MILLI_PER_GPU)
            if not cards:
                continue
            may = [r for r in gpu_waiting if not r.gpu_models or sig.gpu_model in r.gpu_models]
            if may and all(r.cpu_milli > sig.free_cpu or r.memory_mib > sig.free_memory for r in may):
                stranded += cards
        samples["whole free cards whose node's CPU/memory no waiting request fits"].append(stranded)
        for k in ("multi", "one", "share"):
            samples[f"waiting GPU, {k}"].append(waiting[k])

    def admit(r: Request) -> Decision:
        nonlocal shown
        if sim.now >= a.warmup and r.num_gpu == 1:
            mine, theirs = scheduler.decide(r).placement, shadow.decide(r).placement
            if mine is not None and theirs is not None:
                i, j = state.index[mine.node], state.index[theirs.node]
                counts[f"{kind(r)}: decisions"] += 1
                counts[f"{kind(r)}: other node than {a.shadow}"] += i != j
                counts[f"{kind(r)}: policy breaks a big node"] += whole(state, i) >= a.big
                counts[f"{kind(r)}: {a.shadow} breaks a big node"] += whole(state, j) >= a.big
                if r.is_sharing and (i, mine.gpus) != (j, theirs.gpus):
                    # where the two put a share on different cards: what each leaves on its card
                    for who, where, card in (("policy", i, mine.gpus[0]), (a.shadow, j, theirs.gpus[0])):
                        left = state.free_gpu[where][card] - r.gpu_milli
                        counts[f"share, other card: {who} leaves {'< 200' if left < 200 else '200-999'}"] += 1
                if whole(state, i) >= a.big > whole(state, j):
                    counts[f"{kind(r)}: policy breaks a big node, {a.shadow} does not"] += 1
                    if shown < a.show:
                        shown += 1
                        print(f"{kind(r)} cpu {r.cpu_milli} gpu {r.gpu_milli}")
                        print(f"   policy's node: {terms(meter, state, r, i)}")
                        print(f"   {a.shadow}'s node:  {terms(meter, state, r, j)}")
        return loop.admit(r)

    arrivals = synthetic_arrivals(
        shapes, parse_arrivals(f"poisson:{a.rate}"), parse_lifetime(a.lifetime), seed=a.seed, until=a.duration
    )
    sim = ChurnSimulation(
        scheduler,
        arrivals,
        until=a.duration,
        clock=ManualClock(),
        queue=True,
        period=5.0,
        hooks=[hook, sample],
        warmup=a.warmup,
        admission=admit,
        on_release=hook.released,
    )
    report = sim.run()
    print(f"{a.policy} seed {a.seed} rate {a.rate}: {report.time_avg_allocated_pct:.2f} % time-averaged allocated")
    for name, values in samples.items():
        print(f"  {name:46s} mean {statistics.mean(values):8.2f}  max {max(values):8.2f}")
    for name, n in sorted(counts.items()):
        print(f"  {name:46s} {n}")
    pending = collections.Counter((i.request.num_gpu, i.request.cpu_milli, i.request.memory_mib) for i in sim.pending)
    print("  queued at end (cards, CPU milli, memory MiB): count", dict(pending.most_common(8)))
    for model in sorted({sig.gpu_model for sig in state.signature if sig.gpu_model}):
        members = [i for i, sig in enumerate(state.signature) if sig.gpu_model == model]
        idle = sum(1 for i in members if all(f >= MILLI_PER_GPU for f in state.signature[i].free_gpu))
        held: collections.Counter[str] = collections.Counter()
        for allocation in state.allocations.values():
            if state.signature[allocation.node_index].gpu_model == model:
                held[kind(allocation.request)] += allocation.request.total_gpu_milli / 1000
        cards = sum(len(state.signature[i].free_gpu) for i in members)
        print(f"  {model}: {len(members)} nodes ({cards} cards), {idle} whole at end; GPU held by", dict(held))
    for cls, w in report.waits.items():
        print(f"  wait {cls:10s} mean {w.mean:7.1f} s  p95 {w.p95:7.1f} s  queued at end {w.queued_at_end}")


if __name__ == "__main__":
    main()
