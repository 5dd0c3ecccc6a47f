"""What internal TLS costs on the gateway → replica hop: CPU µs per inference and throughput, TLS on vs off.

Two replica processes of the same model (``octacloud serve``, the cloud's internal secret on both), one given
a certificate of a fresh internal CA (mutual TLS), one plain. The client is the gateway's own upstream pool
(:class:`~octacloud.gateway.upstream.UpstreamPool`, keep-alive connections; with the cloud's client
context for TLS) for REST, a ``grpc.aio`` channel (insecure, or secure with the cloud's client certificate)
for gRPC, as the gateway's gRPC proxy. Rounds alternate plain / TLS, side by side in one run; per round:
inferences per second and CPU µs per inference, the client's (this process) and the replica's
(``/proc/<pid>/stat``). A last pair of rounds opens a fresh connection for every request: the cost of a
handshake.

Run inside a loopback-only namespace::

    scripts/netns-run python bench/internal_tls.py --models $OCTACLOUD_MODELS --model mlp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2 as pb

from benchutil import cpu_s, free_port
from octacloud.gateway.upstream import UpstreamPool
from octacloud.security import internal_auth
from octacloud.security.internal_tls import InternalCa, InternalClientTls
from record import Recorder, add_flag


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    grpc_port: int
    tls: bool


def start_replica(name: str, repo: Path, model: str, env: dict[str, str], tls: bool) -> Replica:
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "octacloud", "serve", "--repository", str(repo), "--model-control-mode",
            "explicit", "--load-model", model, "--host", "127.0.0.1", "--http-port", str(port),
            "--grpc-port", str(grpc_port), "--metrics-port", "-1", "--threads", "1"]  # fmt: skip
    process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Replica(name, process, port, grpc_port, tls)


async def grpc_round(
    channel: grpc.aio.Channel, r: Replica, request: bytes, secret: str, c: int, seconds: float
) -> dict[str, float]:
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    metadata = ((internal_auth.HEADER, secret),)
    done = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await call(request, metadata=metadata, timeout=30)
            done += 1

    client0, server0, wall0 = time.process_time(), cpu_s(r.process.pid), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.monotonic() - wall0
    client, server = time.process_time() - client0, cpu_s(r.process.pid) - server0
    return {"per_s": done / wall, "client_us": 1e6 * client / done, "replica_us": 1e6 * server / done, "n": done}


async def wait_ready(pool: UpstreamPool, r: Replica, model: str, headers: list[tuple[bytes, bytes]]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if r.process.poll() is not None:
            raise RuntimeError(f"replica {r.name} exited with {r.process.returncode}")
        try:
            answer = await pool.request("127.0.0.1", r.port, b"GET", f"/v2/models/{model}/ready".encode(), headers, b"")
            if answer.status == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"replica {r.name} not ready after 120 s")


async def round_(
    pool: UpstreamPool, r: Replica, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, c: int, seconds: float
) -> dict[str, float]:
    done = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            answer = await pool.request("127.0.0.1", r.port, b"POST", path, headers, body, 30)
            if answer.status != 200:
                raise RuntimeError(f"{r.name}: {answer.status} {answer.body[:200]!r}")
            done += 1

    client0, server0, wall0 = time.process_time(), cpu_s(r.process.pid), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.monotonic() - wall0
    client, server = time.process_time() - client0, cpu_s(r.process.pid) - server0
    return {"per_s": done / wall, "client_us": 1e6 * client / done, "replica_us": 1e6 * server / done, "n": done}


async def fresh_round(
    r: Replica, tls: InternalClientTls | None, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, n: int
) -> dict[str, float]:
    """``n`` requests, each on a new connection (one handshake each; one client context, as the gateway has)."""
    context = tls.context() if tls is not None else None
    client0, server0, wall0 = time.process_time(), cpu_s(r.process.pid), time.monotonic()
    for _ in range(n):
        pool = UpstreamPool(max_idle_per_host=0, tls=context)
        answer = await pool.request("127.0.0.1", r.port, b"POST", path, headers, body, 30)
        assert answer.status == 200, answer.body[:200]
        await pool.close()
    wall = time.monotonic() - wall0
    client, server = time.process_time() - client0, cpu_s(r.process.pid) - server0
    return {"per_s": n / wall, "client_us": 1e6 * client / n, "replica_us": 1e6 * server / n, "n": n}


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="octacloud-tls-bench-"))
    try:
        secret_file = work / internal_auth.FILE_NAME
        secret = internal_auth.ensure_secret(secret_file)
        ca = InternalCa.ensure(work / "state")
        client_tls = InternalClientTls.issue(ca, work / "state")
        files = ca.issue_replica("bench-tls", ["127.0.0.1"]).write(work / "replica", "replica")
        base = {internal_auth.ENV_VAR: str(secret_file), "OCTACLOUD_THREADS": "1"}
        plain = start_replica("plain", args.models, args.model, base, tls=False)
        secure = start_replica("tls", args.models, args.model, {**base, **files.env()}, tls=True)
        pools = {False: UpstreamPool(), True: UpstreamPool(tls=client_tls.context())}
        try:
            headers = [(internal_auth.HEADER_BYTES, secret.encode()), (b"content-type", b"application/json")]
            for r in (plain, secure):
                await wait_ready(pools[r.tls], r, args.model, headers)
            data = [((i * 37) % 101 - 50) / 50 for i in range(args.features)]
            body = json.dumps(
                {"inputs": [{"name": args.input, "shape": [1, args.features], "datatype": "FP32", "data": data}]}
            ).encode()
            path = f"/v2/models/{args.model}/infer".encode()
            grpc_request = pb.ModelInferRequest(model_name=args.model)
            tensor = grpc_request.inputs.add(name=args.input, datatype="FP32", shape=[1, args.features])
            tensor.contents.fp32_contents.extend(data)
            wire = grpc_request.SerializeToString()
            creds = grpc.ssl_channel_credentials(*client_tls.grpc_credentials_args())
            channels = {
                False: grpc.aio.insecure_channel(f"127.0.0.1:{plain.grpc_port}"),
                True: grpc.aio.secure_channel(f"127.0.0.1:{secure.grpc_port}", creds),
            }
            for r in (plain, secure):  # warm-up
                await round_(pools[r.tls], r, path, headers, body, args.concurrency, 1.0)
                await grpc_round(channels[r.tls], r, wire, secret, args.concurrency, 1.0)
            load_before = os.getloadavg()
            results: dict[str, list[dict[str, float]]] = {"plain": [], "tls": [], "grpc plain": [], "grpc tls": []}
            for _ in range(args.rounds):
                for r in (plain, secure):
                    results[r.name].append(
                        await round_(pools[r.tls], r, path, headers, body, args.concurrency, args.seconds)
                    )
                for r in (plain, secure):
                    results[f"grpc {r.name}"].append(
                        await grpc_round(channels[r.tls], r, wire, secret, args.concurrency, args.seconds)
                    )
            for channel in channels.values():
                await channel.close()
            fresh = {
                "plain": await fresh_round(plain, None, path, headers, body, args.fresh),
                "tls": await fresh_round(secure, client_tls, path, headers, body, args.fresh),
            }
            load_after = os.getloadavg()
        finally:
            for pool in pools.values():
                await pool.close()
            for r in (plain, secure):
                r.process.send_signal(signal.SIGTERM)
            for r in (plain, secure):
                try:
                    r.process.wait(10)
                except subprocess.TimeoutExpired:
                    r.process.kill()
                    r.process.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"keep_alive": results, "fresh_connection": fresh, "loadavg": [load_before, load_after]}


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def report(out: dict[str, object], args: argparse.Namespace) -> None:
    keep = out["keep_alive"]
    fresh = out["fresh_connection"]
    assert isinstance(keep, dict) and isinstance(fresh, dict)
    print(f"model {args.model}, concurrency {args.concurrency}, {args.rounds} rounds of {args.seconds:g} s each, "
          "alternating plain / TLS (mutual, ECDSA P-256) on keep-alive connections")  # fmt: skip
    print(f"{'':22}{'infer/s':>10}{'client µs':>12}{'replica µs':>12}{'total µs':>10}   per round: infer/s, total µs")
    med = {}
    for name in ("plain", "tls", "grpc plain", "grpc tls"):
        rows = keep[name]
        med[name] = {k: median([r[k] for r in rows]) for k in ("per_s", "client_us", "replica_us")}
        m = med[name]
        each = "  ".join(f"{r['per_s']:.0f}/{r['client_us'] + r['replica_us']:.0f}" for r in rows)
        label = ("rest " if not name.startswith("grpc") else "") + name + " (median)"
        print(f"{label:22}{m['per_s']:>10.0f}{m['client_us']:>12.0f}{m['replica_us']:>12.0f}"
              f"{m['client_us'] + m['replica_us']:>10.0f}   {each}")  # fmt: skip
    for protocol, p, t in (("REST", "plain", "tls"), ("gRPC", "grpc plain", "grpc tls")):
        tls, plain = med[t], med[p]
        total_t, total_p = tls["client_us"] + tls["replica_us"], plain["client_us"] + plain["replica_us"]
        extra_client, extra_replica = tls["client_us"] - plain["client_us"], tls["replica_us"] - plain["replica_us"]
        print(f"{protocol} TLS / plain: throughput {tls['per_s'] / plain['per_s']:.3f}, CPU per inference "
              f"{total_t / total_p:.3f} (+{total_t - total_p:.0f} µs: client +{extra_client:.0f}, "
              f"replica +{extra_replica:.0f})")  # fmt: skip
    ft, fp = fresh["tls"], fresh["plain"]
    print(f"a fresh connection per request ({args.fresh} each): plain {fp['per_s']:.0f}/s "
          f"{fp['client_us'] + fp['replica_us']:.0f} µs, TLS {ft['per_s']:.0f}/s "
          f"{ft['client_us'] + ft['replica_us']:.0f} µs: a handshake costs about "
          f"{ft['client_us'] + ft['replica_us'] - fp['client_us'] - fp['replica_us']:.0f} µs of CPU")  # fmt: skip
    load = out["loadavg"]
    assert isinstance(load, list)
    print(f"load average before {load[0][0]:.2f} {load[0][1]:.2f} {load[0][2]:.2f}, "
          f"after {load[1][0]:.2f} {load[1][1]:.2f} {load[1][2]:.2f} on {os.cpu_count()} CPUs")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--input", default="input", help="the model's input tensor")
    parser.add_argument("--features", type=int, default=256, help="the input's one dimension")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fresh", type=int, default=200, help="requests on fresh connections, per side")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    add_flag(parser)
    args = parser.parse_args()
    recorder = Recorder("internal_tls")
    out = asyncio.run(run(args))
    report(out, args)
    recorder.save(out)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
