"""Gateway overhead: perf_analyzer through the octacloud gateway vs directly to the replica, in one run.

    .venv/bin/python bench/cloud.py [--model-dir DIR] [--seconds 2] [--concurrency 1 8]

Starts ``octacloud up`` on a temporary state dir with a one-node CPU fleet, deploys the model (default: the
seeded MLP 256→1024→1024→10, dynamic batching 2 ms, max batch 32) on a whole CPU card, then runs
Triton's perf_analyzer (binary tensors) over HTTP and gRPC at each concurrency against the replica's own
endpoint and against the gateway, and prints throughput, p50/p99 and the gateway/direct ratio.
Goal (issue 6): ≤ 10 % throughput loss at concurrency 8.

Two CPU layouts, both measured by default (``--layout``):

* ``shared``: every process (perf_analyzer, gateway, replica) may run on every core. On a small machine this
  measures CPU contention as much as the gateway: each request through the gateway costs the gateway's CPU,
  taken from the replica and the load generator.
* ``split`` (needs ≥ 2 cores): the gateway process on core 0, the replica and perf_analyzer on the other
  cores, in both the direct and the gateway run — as in production, where the gateway does not share the
  replica's cores. This measures what the gateway itself limits: its added latency and throughput cap.

The gateway requires an API key (issue 8): the bench reads the admin key ``octacloud up`` wrote to
``<state-dir>/admin.key`` and sends it as ``Authorization: Bearer`` (perf_analyzer ``-H``). perf_analyzer
2.51 adds ``-H`` headers to HTTP requests only (no gRPC metadata), so gRPC through the gateway is measured
only with ``--grpc-headers`` (a perf_analyzer that sends them as metadata); by default the gRPC rows show the
replica alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_mlp(repo: Path, name: str = "mlp") -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(42)
    sizes = [256, 1024, 1024, 10]
    nodes, inits, prev = [], [], "INPUT0"
    for k in range(3):
        w = (rng.standard_normal((sizes[k], sizes[k + 1])) / np.sqrt(sizes[k])).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"W{k}"),
            numpy_helper.from_array(np.zeros(sizes[k + 1], np.float32), f"B{k}"),
        ]
        out = "OUTPUT0" if k == 2 else f"H{k}"
        nodes += [helper.make_node("MatMul", [prev, f"W{k}"], [f"M{k}"])]
        if k < 2:
            nodes += [
                helper.make_node("Add", [f"M{k}", f"B{k}"], [f"A{k}"]),
                helper.make_node("Relu", [f"A{k}"], [out]),
            ]
        else:
            nodes += [helper.make_node("Add", [f"M{k}", f"B{k}"], [out])]
        prev = out
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 32\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 10 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )


def perf_analyzer_path() -> str:
    out = subprocess.run(
        ["bash", str(ROOT / "bench/peers/setup.sh"), "perf_analyzer"], check=True, capture_output=True, text=True
    ).stdout
    return out.strip().split(": ", 1)[1]


def admin(url: str, key: str, method: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    req = urllib.request.Request(f"{url}/admin{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as response:
        result: dict[str, object] = json.loads(response.read())
        return result


def run_pa(
    pa: str,
    model: str,
    target: str,
    protocol: str,
    concurrency: int,
    seconds: float,
    shape: str,
    key: str,
    key_over_grpc: bool = False,
) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as f:
        out = f.name
    argv = [
        pa, "-m", model, "-u", target, "-i", protocol, "--shape", shape, "--input-data", "random",
        "--concurrency-range", str(concurrency), "-p", str(int(seconds * 1000)), "-s", "50", "-r", "6", "-f", out,
    ]  # fmt: skip
    if protocol == "http" or key_over_grpc:
        argv += ["-H", f"Authorization:Bearer {key}"]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
    with open(out) as fh:
        row = next(csv.DictReader(fh))
    os.unlink(out)
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


def find_replica_pid(http_port: int) -> int:
    """The local replica process serving ``http_port`` (its command line names the port)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(http_port).encode() in argv:
            return int(entry)
    raise SystemExit(f"no local replica process serving port {http_port}")


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (new threads inherit from the one that starts them)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that just ended
            pass


def place(layout: str, gateway_pid: int, replica_pid: int, cores: int) -> None:
    """Apply a CPU layout to the gateway, the replica and this process (perf_analyzer inherits it)."""
    every = set(range(cores))
    rest = every - {0} if layout == "split" else every
    _pin(gateway_pid, {0} if layout == "split" else every)
    _pin(replica_pid, rest)
    os.sched_setaffinity(0, rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="A Triton-layout model folder to use instead of the MLP.")
    parser.add_argument("--shape", default="INPUT0:256", help="perf_analyzer --shape for the model's input.")
    parser.add_argument("--seconds", type=float, default=2.0, help="perf_analyzer measurement window.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layout", choices=["shared", "split", "both"], default="both", help="CPU layouts to run.")
    parser.add_argument(
        "--grpc-headers", action="store_true", help="perf_analyzer sends -H as gRPC metadata: measure gRPC too."
    )
    args = parser.parse_args()

    pa = perf_analyzer_path()
    work = Path(tempfile.mkdtemp(prefix="octacloud-bench-cloud-"))
    repo = work / "models"
    if args.model_dir:
        repo.mkdir()
        shutil.copytree(args.model_dir, repo / args.model_dir.name)
        model = args.model_dir.name
    else:
        build_mlp(repo)
        model = "mlp"
    cores = os.cpu_count() or 1
    fleet = work / "fleet.yaml"
    fleet.write_text(
        f"nodes:\n  - name: bench\n    cpu_milli: {cores * 1000}\n    memory_mib: 16384\n"
        "    gpu_count: 1\n    gpu_model: cpu\n    gpu_memory_mib: 8192\n"
    )
    http_port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    log = (work / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "octacloud", "up", "--repository", str(repo), "--fleet", str(fleet), "--state-dir",
         str(work / "var"), "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--interval", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        key_file = work / "var" / "admin.key"
        key = ""
        while True:
            try:
                key = key_file.read_text().strip()
                admin(url, key, "GET", "/deployments")
                break
            except OSError:
                if time.monotonic() > deadline or up.poll() is not None:
                    raise SystemExit(f"octacloud up did not start; see {work / 'up.log'}") from None
                time.sleep(0.3)
        # a whole card on a one-card fleet: past the 80 % failover rule, which priority >= 100 may cross
        spec = {"name": model, "model": model, "octants": 8, "priority": 100}
        admin(url, key, "POST", "/deployments", spec)
        replica: dict[str, object] = {}
        while not replica:
            d = admin(url, key, "GET", f"/deployments/{model}")
            ready = [r for r in d["instances"] if r["state"] == "ready"]  # type: ignore[union-attr, index]
            if ready:
                replica = ready[0]
            elif time.monotonic() > deadline + 60:
                raise SystemExit(f"replica not ready; see {work}")
            time.sleep(0.3)
        print(f"replica {replica['id']} on {replica['node']} cards {replica['gpus']} ({cores} cores on this machine)")
        layouts = ["shared", "split"] if args.layout == "both" else [args.layout]
        if "split" in layouts and cores < 2:
            print("(split layout skipped: it needs at least 2 cores)")
            layouts.remove("split")
        replica_pid = find_replica_pid(int(replica["http_port"]))  # type: ignore[call-overload]
        rows = []
        for layout in layouts:
            place(layout, up.pid, replica_pid, cores)
            for protocol in ("http", "grpc"):
                direct = f"127.0.0.1:{replica['http_port' if protocol == 'http' else 'grpc_port']}"
                gateway = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
                for c in args.concurrency:
                    d_res = run_pa(pa, model, direct, protocol, c, args.seconds, args.shape, key)
                    if protocol == "grpc" and not args.grpc_headers:
                        g_res = {"throughput": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
                    else:
                        g_res = run_pa(
                            pa, model, gateway, protocol, c, args.seconds, args.shape, key, args.grpc_headers
                        )
                    rows.append((layout, protocol, c, d_res, g_res))
            place("shared", up.pid, replica_pid, cores)
        print(f"\n{'layout':6} {'protocol':8} {'conc':>4}  {'direct inf/s':>12} {'p50':>7} {'p99':>7}  "
              f"{'gateway inf/s':>13} {'p50':>7} {'p99':>7}  {'gw/direct':>9}")  # fmt: skip
        for layout, protocol, c, d_res, g_res in rows:
            print(
                f"{layout:6} {protocol:8} {c:>4}  {d_res['throughput']:>12.1f} {d_res['p50_ms']:>7.2f} "
                f"{d_res['p99_ms']:>7.2f}  {g_res['throughput']:>13.1f} {g_res['p50_ms']:>7.2f} "
                f"{g_res['p99_ms']:>7.2f}  {g_res['throughput'] / d_res['throughput']:>9.3f}"
            )
        print("\n(latencies in ms; gw/direct is the gateway's throughput as a share of the direct replica's;")
        print(" shared: all processes on all cores; split: gateway on core 0, replica and perf_analyzer on the rest)")
        if not args.grpc_headers:
            print("(gRPC through the gateway: not measured, perf_analyzer 2.51 sends -H headers over HTTP only)")
    finally:
        try:
            admin(url, key, "DELETE", f"/deployments/{model}")  # stops the replica; its slice returns to the pool
        except OSError as exc:
            print(f"warning: could not undeploy {model}: {exc}", file=sys.stderr)
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
