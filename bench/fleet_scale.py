"""The live control plane at fleet scale: the real cloud (controller, store, gateway, meter, dashboard) over an
emulated fleet (control/emulated.py), next to the 8-card cloud and the simulator's pass on the same fleet.

For each size (default: 1 node × 8 cards with 8 replicas, then 125 nodes × 8 cards with 1,000 and 4,000
replicas) one cloud runs in this process on a generated fleet, its replicas emulated in replica host processes,
and the bench prints:

* **deploy → all ready**: the wall time from the deploy calls (mixed models and sizes) until every replica is
  READY, and the controller's passes meanwhile;
* **controller pass** at steady state, and its parts: health (probes), scheduling (the re-evaluation loop's own
  ``run_pass``), execution (launch and stop), the rest (reading the store, counting, routing); the simulator's
  ``run_pass`` on the same fleet and requests (a fresh state, no store, no launcher) for the ratio;
* **route propagation**: what one route-table change costs the gateway workers' hub (the snapshot of every
  route, as JSON) and a worker (applying it), with the hub's poll interval;
* **gateway CPU per request** with every route in the table (a REST load from a client process; this process's
  CPU over the load minus an idle window of the same length);
* **the meter's interval close**, the **store** (rows written per second during the deploy, the SQLite file's
  size), **memory** of this process and of each replica host, the **event stream** (events stored, and the time
  to build the dashboard's document once), and that document drawn in Chromium (``dashboard_render.py``: one
  redraw, and opening the page to the first map);
* **scale-out**: 100 nodes join while an operator's backlog waits for them (whole-card work of the running work's
  priority, which preempts nothing, as much as the old fleet's room and the new nodes' within the failover
  reserve); the passes and seconds until it is placed and until it is ready (none waiting: "measured nothing");
* **failure**: 10 % of the nodes are lost at once (their replicas end, the fleet watcher reports the nodes lost);
  the seconds until every deployment is back at its count, and whether any card was ever given twice.

Run: ``python bench/fleet_scale.py`` (all sizes; ``--sizes 8,1000`` to choose; ``--json FILE`` to keep the
figures). It needs no model files: the emulated replicas never open them. Every server binds 127.0.0.1; run it
inside ``scripts/netns-run``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboard_render import measure as measure_render
from fleet_scale_table import table
from octacloud.admin.dashboard.state import dashboard_state
from octacloud.app import Cloud, CloudConfig
from octacloud.control.controller import ControllerSettings, NodeChange
from octacloud.control.deployments import MAX_REPLICAS, DeploymentSpec, ReplicaState
from octacloud.control.emulated import EmulatedLauncher, EmulationSettings
from octacloud.control.fleet_gen import FleetShape, generated_fleet
from octacloud.core.model import Health
from octacloud.core.units import MILLI_PER_GPU
from octacloud.gateway.feed import _line
from octacloud.gateway.routing import RouteTable
from octacloud.gateway.sharing import apply_snapshot, route_snapshot
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.loop import ReevaluationLoop
from octacloud.serving.emulated import EmulatedLatency
from record import Recorder, add_flag

MODELS = {  # name → (max batch, input dims, output dims): the shapes of the example models, emulated
    "mlp": (32, [256], [10]),
    "resnet50": (32, [3, 224, 224], [1000]),
    "bert_base": (32, [128], [2]),
    "minilm": (64, [128], [384]),
}
MIX = [("mlp", 1), ("minilm", 2), ("bert_base", 4), ("resnet50", 2), ("mlp", 8)]
"""Deployments, as (model, octants per replica), repeated until the replica count is reached."""
SMALL_MIX = [("mlp", 1), ("minilm", 2), ("bert_base", 1), ("resnet50", 2), ("mlp", 1)]
"""The mix where :data:`MIX` would ask for more than :data:`FITS` of the fleet's octants (4,000 of its replicas
need 13,600 octants of 1,000 cards' 8,000; these 5,600): the headroom rule keeps 20 % of the fleet for
failover, so the rest would rightly stay pending ("fits nowhere"), which the bench reports, not waits for."""
FITS = 0.7


def write_repository(root: Path) -> Path:
    for name, (batch, dims, out) in MODELS.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {batch}\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims} }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {out} }} ]\n'
        )
    return root


def plan(replicas: int, deployments: int, cards: int = 0) -> list[tuple[str, str, int, int]]:
    """(deployment, model, octants, replicas) for ``replicas`` replicas over ``deployments`` deployments; with the
    fleet's ``cards``, in :data:`SMALL_MIX` where :data:`MIX` would not fit."""
    mix = MIX
    if cards and sum(o * n for _, _, o, n in plan(replicas, deployments)) > FITS * 8 * cards:
        mix = SMALL_MIX
    out = []
    left = replicas
    for k in range(deployments):
        model, octants = mix[k % len(mix)]
        n = left // (deployments - k)
        out.append((f"{model}-{k}", model, octants, n))
        left -= n
    return out


@dataclass
class Timings:
    """Durations of the controller's parts, by name."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)
    """Calls begun, by name (a pass still running is counted here, not yet in ``seconds``)."""

    def wrap(self, name: str, fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        store = self.seconds.setdefault(name, [])
        self.started.setdefault(name, 0)
        if is_async:

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                self.started[name] += 1
                t = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    store.append(time.perf_counter() - t)

            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.started[name] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                store.append(time.perf_counter() - t)

        return timed

    def reset(self) -> None:
        for v in self.seconds.values():
            v.clear()
        self.started = dict.fromkeys(self.started, 0)


def instrument(cloud: Cloud) -> Timings:
    c = cloud.controller
    t = Timings()
    c.reconcile = t.wrap("pass", c.reconcile, True)  # type: ignore[method-assign]
    c.health.check = t.wrap("health", c.health.check, True)  # type: ignore[method-assign]
    c.loop.run_pass = t.wrap("scheduling", c.loop.run_pass, False)  # type: ignore[method-assign]
    c.executor.execute = t.wrap("execute", c.executor.execute, True)  # type: ignore[method-assign]
    prober = c.health.prober
    prober.probe = t.wrap("health.probe", prober.probe, True)  # type: ignore[method-assign]
    if isinstance(c.launcher, EmulatedLauncher):  # the replica hosts' listings, fetched in a thread each check
        c.launcher.refresh = t.wrap("health.refresh", c.launcher.refresh, False)  # type: ignore[method-assign]
    backing = c.store.backing
    for name in ("put_replica", "delete_replica", "put_deployment", "insert_event", "put_transition"):
        setattr(backing, name, t.wrap(f"store.{name}", getattr(backing, name), False))
    return t


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def until(what: str, predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        await asyncio.sleep(step)
    return time.monotonic() - t0


def all_ready(cloud: Cloud, wanted: int) -> bool:
    replicas = cloud.controller.store.replicas()
    return sum(1 for r in replicas if r.state is ReplicaState.READY and not r.replaces) >= wanted


def cannot_place(cloud: Cloud) -> list[str]:
    """What the scheduler said of each replica it left pending because it fits nowhere (a legitimate outcome of a
    fleet asked for more than it holds, not a stall)."""
    return [r.message for r in cloud.controller.store.replicas() if r.state is ReplicaState.PENDING
            and "fits nowhere" in r.message]  # fmt: skip


def overlaps(cloud: Cloud) -> int:
    """Cards whose replicas together hold more than the card (0 when nothing is placed twice)."""
    held: dict[tuple[str, int], int] = {}
    for r in cloud.controller.store.replicas():
        if r.state in (ReplicaState.READY, ReplicaState.STARTING) and r.node:
            for g in r.gpus:
                held[(r.node, g)] = held.get((r.node, g), 0) + r.milli_per_gpu
    return sum(1 for milli in held.values() if milli > 1000)


def load_cpu_per_request(cloud: Cloud, deployment: str, requests: int) -> tuple[float, int, float]:
    """This process's CPU per request while a client process sends ``requests`` REST inferences to the gateway,
    less its CPU over an idle window of the same length (what the controller and monitor spend anyway); with the
    requests that failed and the load's seconds."""
    key = (cloud.config.state_dir / "admin.key").read_text().strip()
    client = (
        "import httpx, sys, json\n"
        "n, url, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
        "body = {'inputs': [{'name': 'INPUT0', 'shape': [1, 256], 'datatype': 'FP32', 'data': [0.0] * 256}]}\n"
        "failed = 0\n"
        "with httpx.Client(headers={'Authorization': 'Bearer ' + key}, timeout=120) as c:\n"
        "    for _ in range(n):\n"
        "        try:\n"
        "            failed += c.post(url, json=body).status_code != 200\n"
        "        except httpx.HTTPError:\n"
        "            failed += 1\n"
        "print(failed)\n"
    )
    url = f"http://127.0.0.1:{cloud.http_port}/v2/models/{deployment}/infer"
    c0, t0 = cpu_self(), time.monotonic()
    done = subprocess.run([sys.executable, "-c", client, str(requests), url, key], check=True, timeout=900,
                          capture_output=True, text=True)  # fmt: skip
    busy_cpu, wall = cpu_self() - c0, time.monotonic() - t0
    c1 = cpu_self()
    time.sleep(wall)
    idle_cpu = cpu_self() - c1
    return max(0.0, busy_cpu - idle_cpu) / requests, int(done.stdout.split()[-1]), wall


def propagation(routes: RouteTable) -> dict[str, float]:
    """One route change as the gateway workers see it: the hub's snapshot and encoding, a worker's apply."""
    t = time.perf_counter()
    line = _line({"t": "snapshot", **route_snapshot(routes)})
    encode = time.perf_counter() - t
    message = json.loads(line)
    fresh = RouteTable()
    t = time.perf_counter()
    apply_snapshot(fresh, message)
    apply = time.perf_counter() - t
    return {"snapshot_encode_s": encode, "apply_s": apply, "snapshot_bytes": len(line), "hub_poll_s": 0.05}


def simulator_pass(cloud: Cloud) -> float:
    """The scheduler's own pass on the same fleet and requests, as the simulator runs it: a fresh state, every
    replica the controller placed pending again (none pinned), no store and no launcher."""
    c = cloud.controller
    requests = [dataclasses.replace(a.request, pinned=False) for a in c.scheduler.state]
    loop = ReevaluationLoop(Scheduler(ClusterState(list(c.nodes)), c.scheduler.profile))
    t = time.perf_counter()
    report = loop.run_pass(0.0, requests)
    return max(report.seconds, time.perf_counter() - t)


@dataclass
class Size:
    nodes: int
    cards: int
    replicas: int
    deployments: int


async def measure(size: Size, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": size.nodes, "cards": size.nodes * size.cards, "replicas": size.replicas}
    racks = max(1, min(size.nodes, 5))
    fleet = generated_fleet(FleetShape(nodes=size.nodes, cards=size.cards, racks=racks))
    repository = write_repository(work / "models")
    config = CloudConfig(
        repository=repository,
        state_dir=work / "var",
        http_port=0,
        grpc_port=0,
        controller=ControllerSettings(interval_s=5.0),
        emulation=EmulationSettings(EmulatedLatency(args.latency_ms), hosts=args.hosts, idle_exit_s=10.0),
        meter_interval_s=10.0,
    )
    cloud = Cloud(config, nodes=fleet)
    timings = instrument(cloud)
    await cloud.start()
    try:
        await until("the controller's first pass", lambda: bool(timings.seconds["pass"]), 60)
        timings.reset()
        t0 = time.monotonic()
        cards = size.nodes * size.cards
        for name, model, octants, n in plan(size.replicas, size.deployments, cards):
            cloud.controller.deploy(
                DeploymentSpec(name=name, model=model, octants=octants, tenant="admin", min_replicas=n, max_replicas=n)
            )
        ready_s = await until(
            "all replicas ready or found to fit nowhere",
            lambda: all_ready(cloud, size.replicas - len(cannot_place(cloud))),
            args.timeout,
            0.25,
        )
        out["deploy_to_ready_s"], unplaced = ready_s, cannot_place(cloud)
        out["cannot_place"] = len(unplaced)
        print(f"    all {size.replicas - len(unplaced)} placeable ready after {ready_s:.1f} s", flush=True)
        if unplaced:
            print(f"    {len(unplaced)} cannot be placed, e.g. {unplaced[0]}", flush=True)
        writes = sum(len(v) for k, v in timings.seconds.items() if k.startswith("store."))
        out["store_rows_per_s"] = writes / (time.monotonic() - t0)
        out["ramp_passes"] = len(timings.seconds["pass"])
        out["ramp_pass_max_s"] = max(timings.seconds["pass"], default=0.0)
        out["ramp_scheduling_max_s"] = max(timings.seconds["scheduling"], default=0.0)  # the loop held by one pass

        timings.reset()  # steady state: a few full passes with nothing to do
        for _ in range(args.passes):
            cloud.controller.poke()
            n = len(timings.seconds["pass"])
            await until("a pass", lambda n=n: len(timings.seconds["pass"]) > n, args.timeout, 0.02)
        parts = {k: statistics.median(v) for k, v in timings.seconds.items() if v and not k.startswith("store.")}
        out["pass_s"] = parts.get("pass", 0.0)
        out["pass_parts_s"] = parts
        out["probes_per_check"] = timings.started["health.probe"] / max(1, timings.started["health"])
        out["simulator_pass_s"] = simulator_pass(cloud)
        out["propagation"] = propagation(cloud.routes)
        print(f"    steady pass {out['pass_s']:.3f} s ({parts}, {out['probes_per_check']:.0f} probes a check); "
              f"simulator {out['simulator_pass_s']:.3f} s", flush=True)  # fmt: skip
        cpu, failed, wall = await asyncio.to_thread(
            load_cpu_per_request, cloud, plan(size.replicas, size.deployments, cards)[0][0], args.requests
        )
        out["gateway_cpu_us_per_request"], out["gateway_failed"] = 1e6 * cpu, failed
        out["gateway_requests_per_s"] = args.requests / wall
        t = time.perf_counter()
        await cloud.meter.close(cloud.meter.end_ms)
        out["meter_close_s"] = time.perf_counter() - t
        t = time.perf_counter()
        document = dashboard_state(cloud.controller, cloud.monitoring.monitor)
        out["dashboard_state_s"] = time.perf_counter() - t
        out["dashboard_state_bytes"] = len(json.dumps(document))
        if render := await asyncio.to_thread(measure_render, document, 5):  # {} without Chromium
            out["dashboard_render"] = render
        out["events"] = len(cloud.controller.store.backing.events(10**7))
        db = config.state_dir / "octacloud.db"
        out["sqlite_mib"] = sum(p.stat().st_size for p in db.parent.glob("octacloud.db*")) / 2**20
        launcher = cloud.controller.launcher
        assert isinstance(launcher, EmulatedLauncher)
        out["rss_mib"] = {"cloud": rss_mib(os.getpid())} | {h: rss_mib(p) for h, p in launcher.host_pids().items()}
        if size.nodes >= 20:
            for name, phase in (
                ("scale_out", scale_out(cloud, size, timings, args)),
                ("failure", failure(cloud, size, args)),
            ):
                try:
                    out[name] = await phase
                except TimeoutError as exc:  # reported, and the other figures kept
                    out[name] = {"error": str(exc)}
                print(f"    {name}: {out[name]}", flush=True)
    finally:
        await cloud.stop(stop_replicas=True)
        launcher = cloud.controller.launcher
        if isinstance(launcher, EmulatedLauncher):
            launcher.stop_hosts()
    return out


async def scale_out(cloud: Cloud, size: Size, timings: Timings, args: argparse.Namespace) -> dict[str, Any]:
    """100 nodes join while an operator's backlog waits for them: whole-card work of the running work's priority
    (it preempts nothing), as much as the old fleet has room for normal work (whole cards free, within the failover
    reserve) and the joining nodes add. The passes and seconds from the join until what waited is placed, and until
    it is ready; none waiting before the join is reported as a phase that measured nothing."""
    c = cloud.controller
    joining = [dataclasses.replace(n, name=f"x-{n.name}") for n in generated_fleet(FleetShape(nodes=100,
               cards=size.cards, racks=4))]  # fmt: skip
    room = normal_room(cloud)
    added = sum(n.gpu_count for n in joining) * (100 - c.capacity(0).reserve_percent) // 100  # the reserve kept
    wanted = room + added
    parts = -(-wanted // MAX_REPLICAS)  # a deployment holds at most MAX_REPLICAS
    for k in range(parts):
        n = wanted // parts + (k < wanted % parts)
        c.deploy(DeploymentSpec(name=f"wide-{k}", model="mlp", octants=8, tenant="admin", min_replicas=n,
                                max_replicas=n))  # fmt: skip

    def wide() -> list[Any]:
        return [r for k in range(parts) for r in c.store.replicas(f"wide-{k}")]

    def settled() -> bool:  # the old fleet's room taken, and what took it launched: only the backlog is left
        placed = [r for r in wide() if r.node]
        return len(placed) >= room and all(r.state is ReplicaState.READY for r in placed)

    await until("the old fleet's room taken and its replicas ready", settled, args.timeout)
    await asyncio.sleep(2 * c.settings.health_interval_s)
    waiting = sum(1 for r in wide() if not r.node)
    if waiting == 0:
        return {"error": f"measured nothing: none of the {wanted} whole-card replicas waited when the nodes joined"}
    timings.reset()
    c.nodes_changed([NodeChange(node, Health.HEALTHY) for node in joining])  # as the fleet watcher reports them
    placed_s = await until("the waiting work placed", lambda: all(r.node for r in wide()), args.timeout, 0.05)
    passes = timings.started["pass"]  # the passes begun since the join (the one that placed it is still launching)
    scheduling = max(timings.seconds["scheduling"], default=0.0)  # the placing pass's run_pass, on the event loop
    on_new = sum(1 for r in wide() if r.node.startswith("x-"))
    ready_s = await until("the wide deployment ready", lambda: all_ready(cloud, size.replicas + wanted), args.timeout)
    return {"waiting": waiting, "placed_on_new": on_new, "placed_s": placed_s, "passes_to_place": passes,
            "scheduling_s": scheduling, "ready_s": placed_s + ready_s}  # fmt: skip


def normal_room(cloud: Cloud) -> int:
    """Whole cards that work of priority 0 may still take: free whole cards, within the failover reserve."""
    state = cloud.controller.scheduler.state
    free = sum(1 for i, n in enumerate(state.nodes) for g in n.gpus if state.free_gpu[i][g.index] == MILLI_PER_GPU)
    ceiling = cloud.controller.capacity(0).ceiling_milli
    return max(0, min(free, (ceiling - state.allocated_gpu_milli) // MILLI_PER_GPU))


async def failure(cloud: Cloud, size: Size, args: argparse.Namespace) -> dict[str, Any]:
    """10 % of the nodes lost at once: seconds until every deployment is back at its count; any card given twice."""
    c = cloud.controller
    launcher = c.launcher
    assert isinstance(launcher, EmulatedLauncher)
    lost = [n for n in c.nodes if not n.name.startswith("x-")][::10][: max(1, size.nodes // 10)]
    wanted = sum(d.replicas for d in c.store.deployments())
    worst = 0
    for node in lost:
        on_node = [r.id for r in c.store.replicas() if r.node == node.name]
        launcher.crash_node(node.name, on_node)
        c.node_changed(NodeChange(node, Health.FAILED))

    def back() -> bool:
        nonlocal worst
        worst = max(worst, overlaps(cloud))
        return all_ready(cloud, wanted)

    recovered = await until("every deployment back at its count", back, args.timeout, 0.25)
    return {"nodes_lost": len(lost), "recovery_s": recovered, "cards_given_twice": worst}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = []
    for token in args.sizes.split(","):
        replicas = int(token)
        if replicas <= 8:
            sizes.append(Size(1, 8, replicas, min(replicas, 4)))
        else:
            sizes.append(Size(125, 8, replicas, max(5, replicas // 100)))
    results = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="octacloud-fleet-scale-") as tmp:
            print(f"... {size.nodes} node(s) × {size.cards} cards, {size.replicas} replicas", flush=True)
            t = time.monotonic()
            results.append(await measure(size, Path(tmp), args))
            print(f"    done in {time.monotonic() - t:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1000,4000", help="Replica counts (≤ 8: the 8-card cloud).")
    parser.add_argument("--hosts", type=int, default=4, help="Replica host processes.")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="Each emulated batch's latency.")
    parser.add_argument("--passes", type=int, default=5, help="Steady-state passes to time.")
    parser.add_argument("--requests", type=int, default=2000, help="Requests for the gateway's CPU figure.")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds any one phase may take.")
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    add_flag(parser)
    args = parser.parse_args()
    recorder = Recorder("fleet_scale")
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()
    results = asyncio.run(main_async(args))
    print(f"\nload average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print(table(results))
    recorder.save(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
