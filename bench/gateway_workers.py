"""Gateway workers: throughput and CPU per request with the fronts in the cloud's own process (0) and in 1, 2 and 4
gateway processes, in one run.

    .venv/bin/python bench/gateway_workers.py [--workers 0 1 2 4] [--rounds 3] [--seconds 4] [--connections 16]

Starts ``octacloud up --gateway-workers N`` on one temporary state dir (one CPU node, one card) with a tiny
model (16 floats in, ReLU out, dynamic batching up to 64) so that the replica costs little next to the gateway;
the replica started by the first run is adopted by every later one (``up`` restarts, replicas keep running).
Each round measures every worker count once, in a rotated order (interleaved rounds: drift in the machine's
load spreads over all counts alike). The load is a closed loop of ``--connections`` keep-alive HTTP/1.1
connections (JSON bodies, ``Authorization: Bearer``), spread over ``--clients`` client processes: many
connections, because the kernel spreads connections, not requests, over the workers (``--per-worker``: that
many connections per worker, so that each gateway process carries the same load whatever N is; ``--ask gateway``:
``GET /v2``, answered by the gateway itself, to measure its own cost without a replica). The cloud runs
without an in-flight bound (``--limit max_inflight_per_replica=0``): the bench measures the gateway, not load shedding.

Per point it prints throughput, p50/p99, the CPU that all gateway processes together spent per answered
request (``/proc/PID/stat`` utime+stime of ``octacloud up`` and its workers over the point ÷ the requests the
clients got answered; with 0 workers the one process also runs the controller, with N ≥ 1 the main process's
controller and feed are included), the replica's CPU per request, and the 1-minute load average; then, per
worker count, the median over rounds and its ratio to the first count given. With the cores to spare, throughput should
grow with the workers while CPU per request stays flat; on a machine with fewer cores than processes, a flat
CPU per request is the evidence that the workers add no cost, and throughput is bounded by the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchutil import cpu_s as process_cpu_s
from benchutil import free_port
from record import Recorder, add_flag

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
WIDTH = 16
CONFIG = f"""name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 0 }}
"""


def build_model(repo: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["INPUT0"], ["OUTPUT0"])],
        MODEL,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / MODEL / "1").mkdir(parents=True)
    onnx.save(model, str(repo / MODEL / "1" / "model.onnx"))
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)


def cpu_s(pid: int) -> float:
    """As :func:`benchutil.cpu_s`, 0 for a process that is gone (a worker restarted during a point)."""
    try:
        return process_cpu_s(pid)
    except FileNotFoundError:
        return 0.0


def switches(pid: int) -> int:
    """Context switches of all the process's threads so far (voluntary: it waited for work; involuntary: preempted)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
                if line.endswith("ctxt_switches:") or "ctxt_switches:" in line:
                    total += int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat[1]) == pid:
                out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def http(url: str, key: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {key}"})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None


class Up:
    """``octacloud up`` with N gateway workers on the bench's state dir."""

    def __init__(self, repo: Path, state: Path, workers: int) -> None:
        self.port, grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["-m", "octacloud", "up", "--repository", str(repo), "--state-dir", str(state),
                "--http-port", str(self.port), "--grpc-port", str(grpc_port), "--cpu-nodes", "1", "--cpu-cards", "1",
                "--interval", "1", "--gateway-workers", str(workers),
                "--limit", "max_inflight_per_replica=0"]  # fmt: skip  # measure the gateway, not load shedding
        self.log = open(state.parent / f"up-{workers}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, *args], stdout=self.log, stderr=subprocess.STDOUT)
        self.workers = workers
        self.key = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"octacloud up exited with {self.proc.returncode}; see {self.log.name}")
            if (state / "admin.key").exists() and http(f"{self.url}/v2/health/ready", "")[0] == 200:
                self.key = (state / "admin.key").read_text().strip()
                return
            time.sleep(0.2)
        raise SystemExit("octacloud up did not become ready")

    def gateway_pids(self) -> list[int]:
        workers = [p for p in children(self.proc.pid) if "octacloud.gateway.workers" in cmdline(p)]
        if self.workers > 0 and len(workers) != self.workers:
            raise SystemExit(f"expected {self.workers} gateway workers, found {len(workers)}")
        return [self.proc.pid, *workers]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def request_bytes(port: int, key: str, ask: str = "model") -> bytes:
    if ask == "gateway":  # answered by the gateway itself: its own cost, no replica
        return f"GET /v2 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    data = [round(0.1 * (i - WIDTH / 2), 2) for i in range(WIDTH)]
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, WIDTH], "datatype": "FP32", "data": data}]}).encode()
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)


async def client(port: int, key: str, connections: int, warmup: float, seconds: float, ask: str) -> dict[str, Any]:
    """Closed loop over ``connections`` keep-alive connections; latencies of answers within the window."""
    wire = request_bytes(port, key, ask)
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + seconds
    latencies: list[float] = []
    failed = 0

    async def one() -> None:
        nonlocal failed
        while loop.time() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                failed += 1
                await asyncio.sleep(0.05)
                continue
            try:
                while loop.time() < end:
                    t0 = time.perf_counter()  # (uvloop's loop.time() counts whole milliseconds)
                    writer.write(wire)
                    head = await reader.readuntil(b"\r\n\r\n")
                    match = _LENGTH.search(head)
                    await reader.readexactly(int(match.group(1)) if match else 0)
                    ok = head[9:12] == b"200"
                    if start <= loop.time() < end:
                        if ok:
                            latencies.append(time.perf_counter() - t0)
                        else:
                            failed += 1
            except (OSError, asyncio.IncompleteReadError):
                failed += 1
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    latencies.sort()
    return {
        "answered": len(latencies),
        "failed": failed,
        "latencies_ms": [x * 1000 for x in latencies[:: max(1, len(latencies) // 2000)]],
    }


def run_clients(args: argparse.Namespace, up: Up, replica: int) -> dict[str, Any]:
    total = args.connections * (max(1, up.workers) if args.per_worker else 1)
    per = [total // args.clients + (i < total % args.clients) for i in range(args.clients)]
    per = [n for n in per if n]
    outputs = [Path(tempfile.mktemp(prefix="octacloud-gwbench-client-", suffix=".json")) for _ in per]
    command = [sys.executable, __file__, "--client", str(up.port), up.key]
    procs = [
        subprocess.Popen([*command, str(n), str(args.warmup), str(args.seconds), str(out), args.ask])
        for n, out in zip(per, outputs, strict=True)
    ]
    time.sleep(args.warmup)
    pids = up.gateway_pids()
    before = [cpu_s(p) for p in pids] + [cpu_s(replica)]
    switched = sum(switches(p) for p in pids)
    t0 = time.monotonic()
    for proc in procs:
        proc.wait(timeout=args.seconds + args.warmup + 60)
    outs = [json.loads(out.read_text()) for out in outputs]
    for out in outputs:
        out.unlink()
    wall = time.monotonic() - t0
    after = [cpu_s(p) for p in pids] + [cpu_s(replica)]
    switched = sum(switches(p) for p in pids) - switched
    answered = sum(o["answered"] for o in outs)
    lat = sorted(x for o in outs for x in o["latencies_ms"])
    gateway_cpu = sum(after[:-1]) - sum(before[:-1])
    main_cpu = after[0] - before[0]  # `octacloud up` itself: the whole gateway with 0 workers, else the controller
    return {
        "throughput": answered / args.seconds,
        "p50_ms": statistics.median(lat) if lat else float("nan"),
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "gateway_us": gateway_cpu / max(1, answered) * 1e6,
        "main_us": main_cpu / max(1, answered) * 1e6,
        "switches": switched / max(1, answered),
        "replica_us": (after[-1] - before[-1]) / max(1, answered) * 1e6,
        "failed": sum(o["failed"] for o in outs),
        "load1": os.getloadavg()[0],
        "wall_s": wall,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, key, n, warmup, seconds, out, ask = sys.argv[2:9]
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        result = asyncio.run(client(int(port), key, int(n), float(warmup), float(seconds), ask))
        Path(out).write_text(json.dumps(result))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--clients", type=int, default=2, help="client processes the connections are spread over")
    p.add_argument(
        "--ask",
        choices=["model", "gateway"],
        default="model",
        help="model: infer on the tiny model; gateway: GET /v2, answered by the gateway itself (no replica)",
    )
    p.add_argument(
        "--per-worker",
        action="store_true",
        help="--connections per gateway worker (N workers: N times as many): the same load on each process",
    )
    add_flag(p)
    args = p.parse_args()
    recorder = Recorder("gateway_workers")
    each = " per worker" if args.per_worker else ""
    print(f"cores: {os.cpu_count()}  connections: {args.connections}{each} over {args.clients} client processes  "
          f"points: {args.seconds:g} s after {args.warmup:g} s warm-up")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="octacloud-gwbench-"))
    repo, state = work / "models", work / "state"
    build_model(repo)
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in args.workers}
    deployed = False
    try:
        for r in range(args.rounds):
            order = args.workers[r % len(args.workers) :] + args.workers[: r % len(args.workers)]
            for n in order:
                up = Up(repo, state, n)
                try:
                    if args.ask == "gateway":
                        point = run_clients(args, up, 0)  # no replica: pid 0 has no /proc entry, 0 CPU
                        results[n].append(point)
                        report(r, n, point)
                        continue
                    if not deployed:
                        spec = {"name": MODEL, "model": MODEL, "octants": 4}
                        status, answer = http(f"{up.url}/admin/deployments", up.key, "POST", spec)
                        if status != 201:
                            raise SystemExit(f"deploy answered {status}: {answer}")
                        deployed = True
                    deadline = time.monotonic() + 120
                    while http(f"{up.url}/v2/models/{MODEL}/ready", up.key)[0] != 200:
                        if time.monotonic() > deadline:
                            raise SystemExit("the replica did not become ready")
                        time.sleep(0.2)
                    _, info = http(f"{up.url}/admin/deployments/{MODEL}", up.key)
                    pids = [i["pid"] for i in info["instances"] if i["state"] == "ready"]
                    point = run_clients(args, up, pids[0])
                finally:
                    up.stop()
                results[n].append(point)
                report(r, n, point)
    finally:
        subprocess.run([sys.executable, "-m", "octacloud", "down", "--state-dir", str(state)], capture_output=True)
    summary(args, results)
    recorder.save({str(n): points for n, points in results.items()})
    print(f"(logs in {work})")


def report(r: int, n: int, point: dict[str, Any]) -> None:
    print(f"round {r + 1} workers {n}: {point['throughput']:7.0f}/s  p50 {point['p50_ms']:5.2f} ms  "
          f"p99 {point['p99_ms']:6.2f} ms  gateway {point['gateway_us']:5.0f} us/req "
          f"(main {point['main_us']:4.0f}, {point['switches']:.2f} switches/req)  "
          f"replica {point['replica_us']:4.0f} us/req  failed {point['failed']}  "
          f"load {point['load1']:.2f}", flush=True)  # fmt: skip


def summary(args: argparse.Namespace, results: dict[int, list[dict[str, Any]]]) -> None:
    base = statistics.median(x["throughput"] for x in results[args.workers[0]])
    base_cpu = statistics.median(x["gateway_us"] for x in results[args.workers[0]])
    print(f"\nmedian over {args.rounds} rounds (ratios to {args.workers[0]} worker(s)):")
    for n, points in results.items():
        tput = statistics.median(x["throughput"] for x in points)
        cpu = statistics.median(x["gateway_us"] for x in points)
        p99 = statistics.median(x["p99_ms"] for x in points)
        print(f"  workers {n}: {tput:7.0f}/s ({tput / base:4.2f}x)  p99 {p99:6.2f} ms"
              f"  gateway CPU {cpu:5.0f} us/req ({cpu / base_cpu:4.2f}x)"
              f"  {statistics.median(x['switches'] for x in points):.2f} switches/req"
              f"  load {statistics.median(x['load1'] for x in points):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
