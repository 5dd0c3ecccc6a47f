"""Graceful at the knee: offered load from below to above capacity, over HTTP and gRPC, direct and through
the gateway; does the latency of what is admitted stay bounded, and are the rest refused fast?

    .venv/bin/python bench/knee.py [--repository models] [--model mlp] [--multipliers 0.5 0.9 1.2 2 4]
                                   [--seconds 4] [--procs 2] [--limit max_inflight_per_replica=8]

Starts ``octacloud up`` on a temporary state dir with a one-node CPU fleet and deploys the model on a whole
card (one replica). Four targets: the replica's own REST and gRPC ports (with the cloud's internal secret)
and the gateway's (with the admin key). For each target it measures, with ``bench/openloop.py`` (several
processes, raw sockets, requests encoded once, HTTP/1.1 keep-alive or a minimal HTTP/2 gRPC client):

1. unloaded: one request at a time (closed loop, concurrency 1): the p99 every other figure is compared with;
2. capacity: a closed loop of ``--capacity-concurrency`` (the gateway's in-flight bound by default, so that it
   refuses next to nothing): answered calls per second;
3. an open loop (Poisson arrivals) at each multiplier of that target's capacity, the points interleaved
   (multiplier, then protocol, then target, the order alternating) so that drift in the machine's load hits
   every target alike.

Per point: offered/s, admitted/s, refused/s, admitted p50/p99 (from each request's scheduled send time),
admitted p99 ÷ unloaded p99, time to refusal p50/p99, the share of refusals carrying ``Retry-After`` (HTTP
header, gRPC trailing metadata), errors, HTTP requests left unsent because every one of the client's
``--max-connections`` connections was waiting for an answer (the server holding that many), the client's lag
p99 (a point where the client fell behind is marked ``LAG``: its latencies are the client's), and the 1-minute
load average. The goal (docs/gateway.md): through the gateway, admitted p99 within 2× of unloaded above
capacity, refusals in about a millisecond.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from benchutil import LocalCloud, find_replica_pid, proc_stat
from benchutil import cpu_s as process_cpu_s
from record import Recorder, add_flag

HERE = Path(__file__).resolve().parent
INTERNAL_HEADER = "x-octacloud-internal"  # octacloud.security.internal_auth.HEADER


def _openloop() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openloop", HERE / "openloop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["openloop"] = module
    spec.loader.exec_module(module)
    return module


ol = _openloop()


class Cloud(LocalCloud):
    """``octacloud up`` with one replica of ``model`` on the whole card; stopped (and the replica with it) on exit."""

    def __init__(self, repository: Path, model: str, limits: list[str]) -> None:
        super().__init__(repository, prefix="octacloud-knee-", extra=[a for item in limits for a in ("--limit", item)])
        self.model = model
        self.replica: dict[str, Any] = {}

    def start(self, timeout: float = 90.0) -> None:
        super().start(timeout)
        # a whole card on a one-card fleet: past the 80 % failover rule, which priority >= 100 may cross
        self.replica = self.deploy({"name": self.model, "model": self.model, "octants": 8, "priority": 100})

    def targets(self, shape: str) -> dict[tuple[str, str], Any]:
        message = ol.infer_message(self.model, shape)
        out = {}
        for protocol in ("http", "grpc"):
            for where in ("direct", "gateway"):
                if where == "direct":
                    port = int(self.replica["http_port" if protocol == "http" else "grpc_port"])
                    headers: tuple[tuple[str, str], ...] = ((INTERNAL_HEADER, self.secret),)
                else:
                    port = self.http_port if protocol == "http" else self.grpc_port
                    headers = (("authorization", f"Bearer {self.key}"),)
                request = ol.http_infer_request(self.model, shape, headers) if protocol == "http" else message
                out[(protocol, where)] = ol.Target(protocol, "127.0.0.1", port, request, headers)
        return out


def tree(root: int, without: int) -> list[int]:
    """``root`` and its descendants (gateway worker processes, if any), less ``without`` and its own."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(proc_stat(int(entry))[1])
            except (OSError, IndexError, ValueError):
                pass
    out = []
    for pid in parent:
        p, chain = pid, []
        while p > 1 and p != root:
            chain.append(p)
            p = parent.get(p, 0)
        if p == root and without not in chain and pid != without:
            out.append(pid)
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads)."""
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu_s(pid)
        except OSError:
            continue
    return total


class Meter:
    """CPU the gateway's processes and the replica spent while a load ran, per request sent."""

    def __init__(self, cloud: Cloud) -> None:
        self.replica = find_replica_pid(int(cloud.replica["http_port"]))
        self.gateway = tree(cloud.proc.pid, self.replica)

    def run(self, fn: Any) -> tuple[Any, dict[str, float]]:
        g0, r0, t0 = cpu_s(self.gateway), cpu_s([self.replica]), time.monotonic()
        r = fn()
        g, rep, wall = cpu_s(self.gateway) - g0, cpu_s([self.replica]) - r0, time.monotonic() - t0
        n = max(1, r.sent_all)
        return r, {
            "gateway_us_per_request": round(g / n * 1e6, 1),
            "replica_us_per_request": round(rep / n * 1e6, 1),
            "gateway_cores": round(g / wall, 2),
            "replica_cores": round(rep / wall, 2),
        }


def row(name: str, offered: float, r: Any, unloaded_p99: float, lag_limit_ms: float) -> dict[str, Any]:
    s = r.summary()
    s["name"] = name
    s["offered_per_s"] = round(offered, 1)
    s["p99_over_unloaded"] = round(s["p99_ms"] / unloaded_p99, 2) if unloaded_p99 else None
    s["load"] = round(os.getloadavg()[0], 2)
    s["lagged"] = bool(s["client_lag_p99_ms"] > lag_limit_ms)
    return s


def show(s: dict[str, Any]) -> None:
    retry = "-" if s["retry_after_share"] is None else f"{s['retry_after_share'] * 100:.0f}%"
    unsent = s["errors"].get(ol.UNSENT, 0)  # the client's own bound: every connection was waiting for an answer
    errors = sum(s["errors"].values()) - unsent
    print(
        f"  {s['name']:<26} offered {s['offered_per_s']:7.0f}/s  admitted {s['ok_per_s']:6.0f}/s "
        f"p50 {s['p50_ms']:8.2f} p99 {s['p99_ms']:8.2f} ms ({s['p99_over_unloaded']:6.2f}x; from send "
        f"{s['p99_from_send_ms']:8.2f}) | refused "
        f"{s['refused_per_s']:6.0f}/s p50 {s['refusal_p50_ms']:7.2f} p99 {s['refusal_p99_ms']:7.2f} ms "
        f"Retry-After {retry:>4} | errors {errors:5d} unsent {unsent:5d} | lag p99 {s['client_lag_p99_ms']:6.2f} ms"
        f"{' LAG' if s['lagged'] else ''} | cpu us/req gateway {s.get('gateway_us_per_request', 0):5.0f} "
        f"replica {s.get('replica_us_per_request', 0):5.0f} | load {s['load']:.1f}",
        flush=True,
    )


def sweep(args: argparse.Namespace, targets: dict[tuple[str, str], Any], meter: Meter) -> dict[str, Any]:
    load_kw = {"procs": args.procs, "warmup_s": args.warmup, "max_connections": args.max_connections}
    unloaded: dict[tuple[str, str], dict[str, Any]] = {}
    capacity: dict[tuple[str, str], float] = {}
    closed: list[dict[str, Any]] = []
    for target in targets.values():  # warm-up
        ol.run_load(target, seconds=1.0, concurrency=4, procs=1, warmup_s=0.5)
    for key, target in targets.items():
        r, cpu = meter.run(lambda t=target: ol.run_load(t, seconds=args.seconds, concurrency=1, procs=1))
        unloaded[key] = row(f"{key[0]} {key[1]} unloaded", r.sent / r.seconds, r, 0.0, args.lag_limit_ms)
        unloaded[key].update(cpu, p99_over_unloaded=1.0)
        show(unloaded[key])
        concurrencies = [args.capacity_concurrency] + ([args.refusal_concurrency] if key[1] == "gateway" else [])
        for c in concurrencies:
            r, cpu = meter.run(lambda t=target, c=c: ol.run_load(t, seconds=args.seconds, concurrency=c, procs=1))
            if c == args.capacity_concurrency:
                capacity[key] = len(r.ok) / r.seconds
            s = row(f"{key[0]} {key[1]} c={c}", r.sent / r.seconds, r, unloaded[key]["p99_ms"], args.lag_limit_ms)
            s.update(cpu, protocol=key[0], where=key[1], concurrency=c)
            show(s)
            closed.append(s)
    points: list[dict[str, Any]] = []
    order = list(targets)
    for i, m in enumerate(args.multipliers):
        print(f"-- {m:g}x capacity", flush=True)
        for key in order if i % 2 == 0 else order[::-1]:
            rate = m * capacity[key]
            r, cpu = meter.run(
                lambda t=targets[key], rate=rate, i=i: ol.run_load(
                    t, seconds=args.seconds, rate=rate, seed=i, **load_kw
                )
            )
            s = row(f"{key[0]} {key[1]} {m:g}x", rate, r, unloaded[key]["p99_ms"], args.lag_limit_ms)
            s.update(cpu, protocol=key[0], where=key[1], multiplier=m)
            show(s)
            points.append(s)
    return {
        "unloaded": {f"{k[0]} {k[1]}": v for k, v in unloaded.items()},
        "capacity": {f"{k[0]} {k[1]}": round(v, 1) for k, v in capacity.items()},
        "closed": closed,
        "points": points,
    }


def summary(args: argparse.Namespace, out: dict[str, Any]) -> None:
    print(f"\nload average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    print("admitted p99 / unloaded p99 above capacity (goal through the gateway: <= 2x; LAG: client fell behind):")
    for protocol in ("http", "grpc"):
        for where in ("direct", "gateway"):
            name = f"{protocol} {where}"
            if name not in out["unloaded"]:
                continue
            u = out["unloaded"][name]
            cells = []
            for p in out["points"]:
                if p["protocol"] == protocol and p["where"] == where and p["multiplier"] > 1:
                    cells.append(
                        f"{p['multiplier']:g}x: {p['p99_over_unloaded']:.2f}x{' LAG' if p['lagged'] else ''} "
                        f"(refusal p99 {p['refusal_p99_ms']:.1f} ms)"
                    )
            print(
                f"  {name:<13} unloaded p99 {u['p99_ms']:6.2f} ms, capacity {out['capacity'][name]:6.0f}/s | "
                + " | ".join(cells)
            )
    print("gateway CPU per request (closed loops: admitted at the capacity concurrency, mostly refused above it):")
    for s in out["closed"]:
        if s["where"] == "gateway":
            refused = s["refused_per_s"] / max(1.0, s["sent_per_s"])
            print(
                f"  {s['protocol']:<4} c={s['concurrency']:<4} {s['gateway_us_per_request']:6.0f} us/request, "
                f"{refused * 100:3.0f}% refused, {s['sent_per_s']:6.0f}/s answered in all"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--shape", default="input:256", help="the model's input as NAME:DIMS")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[0.5, 0.9, 1.2, 2.0, 4.0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured window per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="sent, not counted, before each window")
    parser.add_argument("--procs", type=int, default=2, help="load generator processes (open loop)")
    parser.add_argument("--capacity-concurrency", type=int, default=8)
    parser.add_argument(
        "--refusal-concurrency",
        type=int,
        default=64,
        help="gateway: a closed loop mostly refused (its CPU per refusal)",
    )
    parser.add_argument("--max-connections", type=int, default=2048, help="HTTP connections at most (all procs)")
    parser.add_argument("--lag-limit-ms", type=float, default=5.0, help="client lag p99 above which a point is void")
    parser.add_argument("--limit", action="append", default=[], help="gateway limit NAME=VALUE (octacloud up)")
    parser.add_argument(
        "--targets", nargs="+", default=["http-direct", "http-gateway", "grpc-direct", "grpc-gateway"],
        choices=["http-direct", "http-gateway", "grpc-direct", "grpc-gateway"],
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure here")
    add_flag(parser)
    args = parser.parse_args()
    recorder = Recorder("knee")

    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cloud = Cloud(args.repository, args.model, args.limit)
    try:
        cloud.start()
        print(
            f"replica {cloud.replica['id']} ({args.model}); gateway limits {args.limit or 'default'}; "
            f"{args.procs} generator processes; load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs",
            flush=True,
        )
        targets = {k: t for k, t in cloud.targets(args.shape).items() if f"{k[0]}-{k[1]}" in args.targets}
        out = sweep(args, targets, Meter(cloud))
        summary(args, out)
        recorder.save(out)
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **out}, indent=1))
    finally:
        cloud.stop()


if __name__ == "__main__":
    main()
