"""octacloud vs. a real Triton Inference Server 2.51, side by side in one run, with Triton's perf_analyzer.

    .venv/bin/python bench/serving.py [--model DIR] [--protocols http grpc] [--concurrency 1 8] [--rounds 2]
                                      [--delay-us 0] [--preferred 32]

Builds the MLP 256→1024→1024→10 (seeded; needs the ``onnx`` package) unless ``--model`` names a model folder
(``1/model.onnx``, a single FP32 input); without ``onnx`` it uses ``$OCTACLOUD_MODELS/mlp`` when present.
Serves it with ``octacloud serve`` and with Triton (python backend wrapping onnxruntime,
``bench/peers/triton_onnx_model.py``), both up at once, and measures with perf_analyzer (binary tensors,
batch-1 requests) point by point, interleaved: each (protocol, concurrency) point runs on one server and then
the other, the order alternating each round, so that load drift on a shared machine hits both alike.

Fairness:

* **The same batching rule.** Both configs get the same ``max_batch_size``, ``max_queue_delay_microseconds``
  and ``preferred_batch_size`` (Triton auto-completes ``preferred_batch_size: [max_batch_size]`` and then
  waits the full delay for it; octacloud without a preferred size dispatches once more than 3 requests wait).
  The bench reads back each server's *effective* configuration, prints the rule it implies, and fails if the
  two differ.
* **CPU per inference**, the stable figure on a noisy machine: each server's process tree's user + system
  time (``/proc/PID/stat``) over the point's whole perf_analyzer run, divided by the inferences the server
  counted (its statistics extension) over the same window. The average batch size comes from the same counts.
  Throughput × CPU per inference is printed as the cores the server kept busy.
* **Unstable points are retried** (perf_analyzer exits non-zero when it cannot get ``-s`` stability); a point
  that stays unstable is reported as such, the run goes on.
* The 1-minute load average is printed with every point.

Peers come from ``bench/peers/setup.sh`` (cache ``$OCTACLOUD_PEERS``, default ``~/.cache/octacloud-peers``);
the script runs it if they are missing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchutil import TICK_S, free_port
from record import Recorder, add_flag

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("OCTACLOUD_PEERS", Path.home() / ".cache" / "octacloud-peers"))
PERF_ANALYZER = PEERS / "perf_analyzer" / "run-perf_analyzer"
TRITONSERVER = PEERS / "triton" / "run-tritonserver"
MERGE_AFTER = 4  # octacloud's default without a preferred size: dispatch once more than 3 requests wait


@dataclass
class Point:
    server: str
    protocol: str
    concurrency: int
    throughput: float = float("nan")
    p50_us: float = float("nan")
    p99_us: float = float("nan")
    cpu_us: float = float("nan")  # server CPU per inference
    batch: float = float("nan")  # average batch size
    load: float = float("nan")
    tries: int = 0
    error: str = ""


class Server:
    """One server process (and its children) with its ports."""

    def __init__(self, kind: str, proc: subprocess.Popen[bytes], http: int, grpc: int) -> None:
        self.kind, self.proc, self.http, self.grpc = kind, proc, http, grpc

    def pids(self) -> list[int]:
        """The server's process tree (Triton's python backend runs in child stub processes)."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def cpu_s(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        return total * TICK_S

    def counts(self, model: str) -> tuple[int, int]:
        """(inferences, executions) the server counted for ``model``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{model}/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"]
        return sum(int(s["inference_count"]) for s in stats), sum(int(s["execution_count"]) for s in stats)

    def config(self, model: str) -> dict[str, object]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{model}/config", timeout=10) as r:
            config: dict[str, object] = json.loads(r.read())
            return config


def mlp_folder(work: Path, seed: int) -> Path:
    try:
        import onnx  # noqa: F401
    except ImportError:
        shipped = Path(os.environ.get("OCTACLOUD_MODELS", "models")) / "mlp"
        if (shipped / "1" / "model.onnx").exists():
            print(f"(onnx is not installed: using {shipped} instead of building the MLP)")
            return shipped
        raise SystemExit(
            "building the MLP needs the onnx package (pip install onnx), or pass --model, "
            "or set OCTACLOUD_MODELS to a repository with an mlp model"
        ) from None
    sys.path.insert(0, str(HERE.parent / "src"))
    from octacloud.serving.testing import mlp_onnx

    folder = work / "src" / "mlp"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(mlp_onnx((256, 1024, 1024, 10), seed=seed))
    return folder


def io_of(onnx_path: Path) -> tuple[str, list[int], str, list[int]]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    i, o = s.get_inputs()[0], s.get_outputs()[0]

    def dims(shape: list[object]) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in shape[1:]]

    return i.name, dims(i.shape), o.name, dims(o.shape)


def batching_text(max_batch: int, delay_us: int, preferred: list[int]) -> str:
    sizes = f"preferred_batch_size: [ {', '.join(map(str, preferred))} ] " if preferred else ""
    return (
        f"max_batch_size: {max_batch}\n"
        f"dynamic_batching {{ {sizes}max_queue_delay_microseconds: {delay_us} }}\n"
        "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
    )


def write_repos(
    model_dir: Path, work: Path, name: str, batching: str, computes: list[str], *, triton: bool = True
) -> dict[str, Path]:
    """Repositories with the same model and batching: octacloud's (onnxruntime; one per ``compute`` mode,
    labelled as :func:`label` says) and, with ``triton``, Triton's (python backend; it reads the Triton peer's
    folder, which ``--skip-triton`` does not need)."""
    onnx = model_dir / "1" / "model.onnx"
    in_name, in_dims, out_name, out_dims = io_of(onnx)
    io = (
        f'input [ {{ name: "{in_name}", data_type: TYPE_FP32, dims: {in_dims} }} ]\n'
        f'output [ {{ name: "{out_name}", data_type: TYPE_FP32, dims: {out_dims} }} ]\n'
    )
    repos = {}
    for compute in computes:
        ours = work / label(compute) / name
        (ours / "1").mkdir(parents=True)
        shutil.copy(onnx, ours / "1" / "model.onnx")
        where = f'parameters {{ key: "compute" value {{ string_value: "{compute}" }} }}\n'
        (ours / "config.pbtxt").write_text(f'backend: "onnxruntime"\n{batching}{io}{where}')
        repos[label(compute)] = ours.parent
    if not triton:
        return repos
    theirs = work / "triton" / name
    (theirs / "1").mkdir(parents=True)
    shutil.copy(onnx, theirs / "1" / "model.onnx")
    (theirs / "config.pbtxt").write_text(f'backend: "python"\n{batching}{io}')
    site = (PEERS / "triton" / "site-packages.txt").read_text().strip()
    body = (HERE / "peers" / "triton_onnx_model.py").read_text()
    (theirs / "1" / "model.py").write_text(f"import sys; sys.path.insert(0, {site!r})\n{body}")
    repos["triton"] = theirs.parent
    return repos


def label(compute: str) -> str:
    """octacloud's label in the output: "octacloud" (compute in the replica) or "octa-proc" (in a child)."""
    return "octacloud" if compute == "replica" else "octa-proc"


def effective_rule(kind: str, config: dict[str, object]) -> str:
    """The batching rule a server's effective (auto-completed) config implies, in words."""
    max_batch = int(str(config.get("max_batch_size", 0)))
    db = config.get("dynamic_batching")
    if max_batch <= 0 or not isinstance(db, dict):
        return "no batching"
    delay = int(str(db.get("max_queue_delay_microseconds", 0)))
    preferred = sorted(int(str(p)) for p in db.get("preferred_batch_size", []) or [])
    if delay <= 0:
        return f"max {max_batch} rows, dispatch whatever waits as soon as the instance is free"
    if preferred:
        wait = f"{preferred[-1]} rows wait"
    elif kind == "triton":
        wait = f"{max_batch} rows wait"  # Triton without a preferred size forms the largest batch it can
    else:
        wait = f"{MERGE_AFTER} requests wait"
    return f"max {max_batch} rows, dispatch once {wait} or the oldest waited {delay} us"


def wait_ready(port: int, model: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"no ready model {model} on port {port} after {timeout} s")


def start(kind: str, repo: Path, threads: int, work: Path, extra: list[str]) -> Server:
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = {**os.environ, "OCTACLOUD_THREADS": str(threads), "OCTACLOUD_BENCH_THREADS": str(threads)}
    if kind != "triton":
        exe = Path(sys.executable).parent / "octacloud"
        cmd = [str(exe), "serve", "--repository", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--threads", str(threads), "--log-level", "warning", *extra]  # fmt: skip
    else:
        cmd = [str(TRITONSERVER), f"--model-repository={repo}", "--http-address=127.0.0.1",
               "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", f"--http-port={http}",
               f"--grpc-port={grpc}", f"--metrics-port={metrics}", "--log-verbose=0"]  # fmt: skip
    log = (work / f"{kind}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(kind, proc, http, grpc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(
    server: Server, model: str, protocol: str, c: int, shape: str, args: argparse.Namespace, work: Path
) -> Point:
    point = Point(server.kind, protocol, c)
    port = server.http if protocol == "http" else server.grpc
    out = work / f"pa-{server.kind}-{protocol}-{c}.csv"
    cmd = [str(PERF_ANALYZER), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol, "--shape", shape,
           "--input-data", "random", "--concurrency-range", str(c), "-p", str(args.window_ms),
           "-s", str(args.stability), "-r", "6", "-f", str(out)]  # fmt: skip
    for attempt in range(1, args.retries + 2):
        point.tries = attempt
        point.load = os.getloadavg()[0]
        out.unlink(missing_ok=True)
        cpu0, (inf0, exe0) = server.cpu_s(), server.counts(model)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        cpu1, (inf1, exe1) = server.cpu_s(), server.counts(model)
        if run.returncode == 0 and out.exists():
            with out.open() as f:
                row = next(csv.DictReader(f))
            point.throughput = float(row["Inferences/Second"])
            point.p50_us, point.p99_us = float(row["p50 latency"]), float(row["p99 latency"])
            point.cpu_us = (cpu1 - cpu0) / max(1, inf1 - inf0) * 1e6
            point.batch = (inf1 - inf0) / max(1, exe1 - exe0)
            point.error = ""
            return point
        tail = (run.stdout + run.stderr).strip().splitlines()
        point.error = tail[-1] if tail else f"perf_analyzer exited with {run.returncode}"
        if inf1 > inf0:  # unstable, not broken: the server's own counts still give CPU per inference
            point.cpu_us = (cpu1 - cpu0) / (inf1 - inf0) * 1e6
            point.batch = (inf1 - inf0) / max(1, exe1 - exe0)
    return point


def open_loop(server: Server, model: str, rate: int, shape: str, seconds: float) -> dict[str, float]:
    """Open-loop gRPC at ``rate``/s (Poisson, bench/loadgen.py): p99 of the answered calls, refusals per second."""
    argv = [sys.executable, str(HERE / "loadgen.py"), f"127.0.0.1:{server.grpc}", model, shape, "--rate", str(rate),
            "--seconds", str(seconds)]  # fmt: skip
    load = os.getloadavg()[0]
    cpu0, (inf0, _) = server.cpu_s(), server.counts(model)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    cpu1, (inf1, _) = server.cpu_s(), server.counts(model)
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()
        raise RuntimeError(f"the load generator failed: {tail[-1] if tail else run.returncode}")
    result: dict[str, float] = json.loads(run.stdout)
    result["cpu_us"] = (cpu1 - cpu0) / max(1, inf1 - inf0) * 1e6
    result["load"] = load
    return result


def show(p: Point) -> str:
    if p.error:
        return (
            f"  {p.server:9} {p.protocol:4} c={p.concurrency}: FAILED after {p.tries} tries: {p.error}"
            f"  (cpu {p.cpu_us:5.0f} us/inf  batch {p.batch:4.1f}  load {p.load:4.1f})"
        )
    return (
        f"  {p.server:9} {p.protocol:4} c={p.concurrency}: {p.throughput:7.0f} infer/s  p50 {p.p50_us / 1e3:6.2f} ms"
        f"  p99 {p.p99_us / 1e3:6.2f} ms  cpu {p.cpu_us:5.0f} us/inf ({p.throughput * p.cpu_us / 1e6:4.2f} cores)"
        f"  batch {p.batch:4.1f}  load {p.load:4.1f}" + (f"  ({p.tries} tries)" if p.tries > 1 else "")
    )


def median(values: list[float]) -> float:
    good = [v for v in values if v == v]
    return statistics.median(good) if good else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (1/model.onnx); default: the MLP")
    p.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads, both servers")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=0, help="max_queue_delay_microseconds, both servers")
    p.add_argument(
        "--preferred", type=int, nargs="*", default=None, help="preferred_batch_size, both (default: [max-batch])"
    )
    p.add_argument("--rounds", type=int, default=2, help="each point this many times, the order alternating")
    p.add_argument("--window-ms", type=int, default=3000)
    p.add_argument("--stability", type=int, default=50, help="perf_analyzer -s (percent)")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a point perf_analyzer found unstable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-triton", action="store_true")
    p.add_argument(
        "--rates", type=int, nargs="*", default=[], help="open-loop gRPC points (requests/s, Poisson), both servers"
    )
    p.add_argument(
        "--compute",
        nargs="+",
        default=["replica"],
        choices=["replica", "process"],
        help="where octacloud computes (config parameter 'compute'); several: one octacloud server each",
    )
    p.add_argument("--serve-args", default="", help="more options for octacloud serve, e.g. '--grpc-threads 0'")
    add_flag(p)
    args = p.parse_args()
    recorder = Recorder("serving")
    preferred = [args.max_batch] if args.preferred is None else args.preferred

    if not PERF_ANALYZER.exists() or (not args.skip_triton and not TRITONSERVER.exists()):
        subprocess.run([str(HERE / "peers" / "setup.sh")], check=True)
    kinds = [label(c) for c in args.compute] + ([] if args.skip_triton else ["triton"])
    with tempfile.TemporaryDirectory(prefix="octacloud-bench-") as tmp:
        work = Path(tmp)
        model_dir = args.model or mlp_folder(work, args.seed)
        name = model_dir.name
        in_name, in_dims, _, _ = io_of(model_dir / "1" / "model.onnx")
        shape = f"{in_name}:{','.join(str(max(1, d)) for d in in_dims)}"
        batching = batching_text(args.max_batch, args.delay_us, preferred)
        repos = write_repos(model_dir, work, name, batching, args.compute, triton=not args.skip_triton)
        servers: dict[str, Server] = {}
        try:
            for kind in kinds:
                servers[kind] = start(kind, repos[kind], args.threads, work, args.serve_args.split())
            for s in servers.values():
                wait_ready(s.http, name, s.proc)
            print(
                f"model {name}: input {in_name} {in_dims}; 1 instance, {args.threads} onnxruntime thread(s); "
                f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
            )
            rules = {k: effective_rule(k, s.config(name)) for k, s in servers.items()}
            for k, rule in rules.items():
                print(f"  {k:9} effective batching: {rule}")
            if len(set(rules.values())) > 1:
                raise SystemExit("the servers' effective batching rules differ: the comparison would not be fair")
            points: list[Point] = []
            for r in range(args.rounds):
                for protocol in args.protocols:
                    for c in args.concurrency:
                        order = kinds if r % 2 == 0 else kinds[::-1]
                        for kind in order:
                            points.append(measure(servers[kind], name, protocol, c, shape, args, work))
                            print(show(points[-1]), flush=True)
            opened: list[tuple[int, str, dict[str, float]]] = []
            for i, rate in enumerate(args.rates):
                for kind in kinds if i % 2 == 0 else kinds[::-1]:
                    o = open_loop(servers[kind], name, rate, shape, args.window_ms / 1000)
                    opened.append((rate, kind, o))
                    print(
                        f"  {kind:9} grpc open loop {rate}/s: answered {o['throughput']:6.0f}/s  p50 "
                        f"{o['p50_ms']:6.2f} ms  p99 {o['p99_ms']:7.2f} ms  refused {o['refused']:5.0f}/s  "
                        f"failed {o['failed']:4.0f}/s  cpu {o['cpu_us']:4.0f} us/inf  load {o['load']:4.1f}  "
                        f"client lag p99 {o['client_lag_p99_ms']:5.1f} ms",
                        flush=True,
                    )
        finally:
            for s in servers.values():
                stop(s.proc)

    print(f"\nmedians over {args.rounds} round(s); load now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{'protocol':8} {'c':>2} | {'server':9} {'infer/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'cpu us/inf':>10} "
        f"{'cores':>5} {'batch':>5} | {'thr ratio':>9} {'p99 ratio':>9} {'cpu ratio':>9}"
    )
    figures: dict[str, Any] = {"medians": [], "open_loop": [{"rate": r, "server": k, **o} for r, k, o in opened]}
    for protocol in args.protocols:
        for c in args.concurrency:
            med = {}
            for kind in kinds:
                mine = [x for x in points if (x.server, x.protocol, x.concurrency) == (kind, protocol, c)]
                fields = ("throughput", "p50_us", "p99_us", "cpu_us", "batch")
                med[kind] = {f: median([getattr(x, f) for x in mine]) for f in fields}
            for kind in kinds:
                m = med[kind]
                figures["medians"].append({"protocol": protocol, "concurrency": c, "server": kind, **m})
                ratios = ""
                if kind != "triton" and "triton" in med:
                    t = med["triton"]
                    ratios = (
                        f"{m['throughput'] / t['throughput']:9.2f} {m['p99_us'] / t['p99_us']:9.2f} "
                        f"{m['cpu_us'] / t['cpu_us']:9.2f}"
                    )
                print(
                    f"{protocol:8} {c:2} | {kind:9} {m['throughput']:8.0f} {m['p50_us'] / 1e3:7.2f} "
                    f"{m['p99_us'] / 1e3:7.2f} {m['cpu_us']:10.0f} {m['throughput'] * m['cpu_us'] / 1e6:5.2f} "
                    f"{m['batch']:5.1f} | {ratios}"
                )
    print(
        "\noctacloud: the model computed in the replica's process (the default); octa-proc: in a child process "
        "(config parameter compute: process)."
        "\nthr ratio = octacloud/triton throughput (>= 1 is the goal); p99 ratio and cpu ratio = octacloud/triton "
        "p99 latency and server CPU per inference (<= 1 is the goal); cores = infer/s x CPU per inference, the "
        "cores the server kept busy (octacloud's replica runs its protocol, batching and short batches on one loop: "
        "near 1.0 it is saturated)."
    )
    recorder.save(figures)


if __name__ == "__main__":
    main()
