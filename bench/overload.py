"""Load shedding at the gateway: does overload leave the latency of admitted requests bounded?

    .venv/bin/python bench/overload.py --repository models [--model mlp] [--seconds 8] [--bound N]

Starts one replica (``octacloud serve``) and, side by side in front of it, two gateways (separate processes):
one with the per-deployment in-flight bound (``GatewayLimits.max_inflight_per_replica``, 503 + Retry-After
beyond it) and one without. For each it measures, with a raw keep-alive HTTP/1.1 client (JSON inference,
batch 1):

1. unloaded: one request at a time (the p99 every other figure is compared with);
2. closed loop, 1,024 connections each sending its next request as soon as it has an answer; a refused
   client waits as its answer's ``Retry-After`` says (``--refused-pause S`` overrides it: 0 is a client
   that retries at once);
3. open loop at ``--overload`` times the capacity (the throughput of 64 connections through the unbounded
   gateway, measured first; Poisson arrivals, a new connection whenever no idle one is free).

Prints p50/p99 of admitted requests, the refused count and how fast refusals came, and the ratio of admitted
p99 to unloaded p99 for both gateways; plus the load average (this machine is shared; compare within a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import free_port
from octacloud.gateway.limits import GatewayLimits

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
HEADER = "x-octacloud-internal"  # what replicas of a cloud require (octacloud.protocols.internal.HEADER)


def wait_http(url: str, timeout: float = 120.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not become ready within {timeout:g} s")


# ---- the gateway process ------------------------------------------------------------------------------


def run_gateway(port: int, replica_port: int, bound: int, secret_file: str, model: str) -> None:
    sys.path.insert(0, str(SRC))
    import contextvars

    from octacloud.gateway.fronts import RestFront
    from octacloud.gateway.limits import GatewayLimits
    from octacloud.gateway.rest import RestGateway
    from octacloud.gateway.routing import Endpoint, Owner, RouteTable
    from octacloud.protocols.rest.request import Http1Request
    from octacloud.protocols.server import new_event_loop
    from octacloud.security.internal_auth import read_secret

    limits = GatewayLimits(max_inflight_per_replica=bound)
    routes = RouteTable()
    routes.update(model, [Endpoint("r0", "127.0.0.1", replica_port, 0)])
    routes.owners[model] = Owner("bench")
    gateway = RestGateway(routes, limits=limits, internal_secret=read_secret(Path(secret_file)))
    seen: list[float] = []
    status: contextvars.ContextVar[int] = contextvars.ContextVar("status", default=0)  # each request is a task
    attempts = gateway._attempts

    async def answered(*args: Any) -> Any:
        response = await attempts(*args)
        status.set(response.status)
        return response

    gateway._attempts = answered  # type: ignore[method-assign]

    class Timed:
        """The gateway on its own front, timing each admitted answer from its parsed request to its last byte
        handed to the transport (the gateway's view: no client event-loop lag, no accept queue);
        ``/bench/seen`` answers them as JSON and starts a new phase."""

        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            await gateway(scope, receive, send)  # the lifespan

        async def serve_http1(self, request: Http1Request) -> None:
            if request.path == "/bench/seen":
                request.respond(200, b"", json.dumps(seen).encode())
                seen.clear()
                return
            started = time.perf_counter()
            status.set(0)
            await gateway.serve_http1(request)
            if status.get() == 200:
                seen.append(time.perf_counter() - started)

    async def serve() -> None:
        front = RestFront(Timed(), limits)
        await front.start("127.0.0.1", port, reuse_port=False)
        await asyncio.Event().wait()  # until SIGTERM ends the process

    loop = new_event_loop()
    loop.run_until_complete(serve())


# ---- the client ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    admitted: list[float] = field(default_factory=list)
    at_gateway: list[float] = field(default_factory=list)
    """The same admitted requests as the gateway timed them."""
    refused: list[float] = field(default_factory=list)
    other: int = 0
    seconds: float = 0.0


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def call(self, request: bytes) -> tuple[int, bool, float]:
        """Send one request; (status, whether the connection may be reused, Retry-After seconds or 0)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, close, retry = 0, False, 0.0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                close = True
            elif name == b"retry-after":
                retry = float(value)
        if length:
            await self.reader.readexactly(length)
        return status, not close, retry

    def close(self) -> None:
        self.writer.close()


def infer_request(model: str) -> bytes:
    rng = random.Random(0)
    body = json.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [rng.random() for _ in range(256)]}
            ]
        }
    ).encode()
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def closed_loop(
    port: int, request: bytes, concurrency: int, seconds: float, refused_pause: float | None = None
) -> Sample:
    sample = Sample()
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        conn: Connection | None = None
        while time.perf_counter() < stop_at:
            try:
                if conn is None:
                    conn = await Connection.open(port)
                started = time.perf_counter()
                status, reuse, retry = await conn.call(request)
                took = time.perf_counter() - started
            except (OSError, asyncio.IncompleteReadError, ValueError):
                sample.other += 1
                if conn is not None:
                    conn.close()
                conn = None
                await asyncio.sleep(0.01)
                continue
            if not reuse:
                conn.close()
                conn = None
            if status == 200:
                sample.admitted.append(took)
            elif status in (429, 503):
                sample.refused.append(took)
                await asyncio.sleep(retry if refused_pause is None else refused_pause)
            else:
                sample.other += 1
        if conn is not None:
            conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    sample.seconds = time.perf_counter() - started
    return sample


async def open_loop(port: int, request: bytes, rate: float, seconds: float, max_connections: int = 4096) -> Sample:
    sample = Sample()
    idle: list[Connection] = []
    opened = 0
    rng = random.Random(1)
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        nonlocal opened
        started = time.perf_counter()
        try:
            if idle:
                conn = idle.pop()
            elif opened < max_connections:
                opened += 1
                conn = await Connection.open(port)
            else:
                sample.other += 1  # the client ran out of connections: counted, not hidden
                return
            status, reuse, _ = await conn.call(request)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            sample.other += 1
            return
        took = time.perf_counter() - started
        if reuse:
            idle.append(conn)
        else:
            conn.close()
            opened -= 1
        if status == 200:
            sample.admitted.append(took)
        elif status in (429, 503):
            sample.refused.append(took)
        else:
            sample.other += 1

    begin = time.perf_counter()
    next_at = begin
    while next_at < begin + seconds:
        now = time.perf_counter()
        if now < next_at:
            await asyncio.sleep(next_at - now)
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    sample.seconds = time.perf_counter() - begin
    for conn in idle:
        conn.close()
    return sample


async def gateway_view(port: int, sample: Sample) -> Sample:
    conn = await Connection.open(port)
    conn.writer.write(b"GET /bench/seen HTTP/1.1\r\nHost: bench\r\n\r\n")
    head = await conn.reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    sample.at_gateway = json.loads(await conn.reader.readexactly(length))
    conn.close()
    return sample


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def report(name: str, s: Sample, unloaded_p99: float) -> None:
    ratio = pct(s.admitted, 0.99) / unloaded_p99 if unloaded_p99 else float("nan")
    print(
        f"  {name:<24} admitted {len(s.admitted):6d} ({len(s.admitted) / s.seconds:7.0f}/s) "
        f"p50 {ms(pct(s.admitted, 0.5))} p99 {ms(pct(s.admitted, 0.99))} ms  p99/unloaded {ratio:5.2f}x | "
        f"refused {len(s.refused):6d} p50 {ms(pct(s.refused, 0.5))} p99 {ms(pct(s.refused, 0.99))} ms | "
        f"errors {s.other} | at the gateway p50 {ms(pct(s.at_gateway, 0.5))} p99 {ms(pct(s.at_gateway, 0.99))} ms"
    )


async def measure(args: argparse.Namespace, ports: dict[str, int]) -> None:
    request = infer_request(args.model)
    unloaded: dict[str, Sample] = {}
    for port in ports.values():  # warm up both
        await gateway_view(port, await closed_loop(port, request, 4, 1.0))
    for name, port in ports.items():
        unloaded[name] = await gateway_view(port, await closed_loop(port, request, 1, args.seconds))
    saturated = await gateway_view(ports["unbounded"], await closed_loop(ports["unbounded"], request, 64, args.seconds))
    capacity = len(saturated.admitted) / saturated.seconds
    closed: dict[str, Sample] = {}
    for name, port in ports.items():
        sample = await closed_loop(port, request, args.concurrency, args.seconds, args.refused_pause)
        closed[name] = await gateway_view(port, sample)
    rate = max(args.overload * capacity, 10.0)
    opened: dict[str, Sample] = {}
    for name, port in ports.items():
        opened[name] = await gateway_view(port, await open_loop(port, request, rate, args.seconds))

    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    pause = "Retry-After" if args.refused_pause is None else f"{args.refused_pause:g} s"
    print(f"model {args.model}, JSON batch 1; {args.seconds:g} s per phase; bound {args.bound} in flight per replica")
    print(f"capacity (64 connections, unbounded gateway) {capacity:.0f}/s; refused closed-loop clients wait {pause}")
    for name in ports:
        u = pct(unloaded[name].admitted, 0.99)
        g = unloaded[name].at_gateway
        print(
            f"{name} gateway: unloaded p50 {ms(pct(unloaded[name].admitted, 0.5))} p99 {ms(u)} ms | "
            f"at the gateway p50 {ms(pct(g, 0.5))} p99 {ms(pct(g, 0.99))} ms"
        )
        report(f"closed loop c={args.concurrency}", closed[name], u)
        report(f"open loop {rate:.0f}/s", opened[name], u)
    ub, uu = pct(unloaded["bounded"].admitted, 0.99), pct(unloaded["unbounded"].admitted, 0.99)
    for phase, table in (("closed loop", closed), ("open loop", opened)):
        b, u = pct(table["bounded"].admitted, 0.99) / ub, pct(table["unbounded"].admitted, 0.99) / uu
        print(f"{phase}: admitted p99 / unloaded p99: bounded {b:.2f}x, unbounded {u:.2f}x (goal: bounded <= 2x)")
        gb = pct(table["bounded"].at_gateway, 0.99) / pct(unloaded["bounded"].at_gateway, 0.99)
        gu = pct(table["unbounded"].at_gateway, 0.99) / pct(unloaded["unbounded"].at_gateway, 0.99)
        print(f"{phase}, as the gateway timed them: bounded {gb:.2f}x, unbounded {gu:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--overload", type=float, default=1.5, help="open-loop rate / bounded capacity")
    parser.add_argument(
        "--bound",
        type=int,
        default=GatewayLimits().max_inflight_per_replica,
        help="in-flight requests per replica (bounded gateway); default: the gateway's own default",
    )
    parser.add_argument("--refused-pause", type=float, default=None, help="default: the answer's Retry-After")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gateway", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gateway:
        port, replica, bound, secret, model = args.gateway
        run_gateway(int(port), int(replica), int(bound), secret, model)
        return

    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp(prefix="octacloud-overload-"))
    secret_file = tmp / "internal.secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    secret = os.urandom(32).hex()
    os.write(fd, secret.encode())
    os.close(fd)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OCTACLOUD_INTERNAL_SECRET_FILE": str(secret_file)}
    replica_port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "octacloud", "serve", "--repository", str(args.repository.resolve()),
             "--model-control-mode", "explicit", "--load-model", args.model, "--host", "127.0.0.1",
             "--http-port", str(replica_port), "--grpc-port", "-1", "--metrics-port", "-1",
             "--threads", str(args.threads)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "replica.log", "w"),  # noqa: SIM115
        )
    ]  # fmt: skip
    ports = {"bounded": free_port(), "unbounded": free_port()}
    try:
        for name, port in ports.items():
            bound = args.bound if name == "bounded" else 0
            argv = [sys.executable, __file__, "--gateway", str(port), str(replica_port), str(bound)]
            procs.append(subprocess.Popen([*argv, str(secret_file), args.model], env=env))
        # the replica answers its cloud only: the model's readiness is asked with the internal secret
        wait_http(f"http://127.0.0.1:{replica_port}/v2/models/{args.model}/ready", headers={HEADER: secret})
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/v2/health/ready")
        try:
            import uvloop

            uvloop.run(measure(args, ports))
        except ImportError:
            asyncio.run(measure(args, ports))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
