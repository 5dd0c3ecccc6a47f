"""octacloud vs. a real Triton Inference Server 2.51, side by side in one run, with Triton's perf_analyzer.

    .venv/bin/python bench/serving.py [--model DIR] [--protocols http grpc] [--concurrency 1 8] [--threads 1]

Builds the MLP 256→1024→1024→10 (seeded) unless ``--model`` names a model folder (``config.pbtxt`` with a
single FP32 input and ``1/model.onnx``). Serves it with ``octacloud serve`` and with Triton (python backend
wrapping onnxruntime, ``bench/peers/triton_onnx_model.py``) under the same batching settings, one server at a
time; runs perf_analyzer (binary tensors, batch-1 requests) at each concurrency; then measures in-process
onnxruntime throughput at the same batch sizes (the limit). Prints throughput and p50/p99 for both, the
ratios, and octacloud's share of the limit. Peers come from ``bench/peers/setup.sh`` (run it first; the
script runs it if the peers are missing).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("OCTACLOUD_PEERS", Path.home() / ".cache" / "octacloud-peers"))
PERF_ANALYZER = PEERS / "perf_analyzer" / "run-perf_analyzer"
TRITONSERVER = PEERS / "triton" / "run-tritonserver"

BATCHING = """max_batch_size: {max_batch}
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


@dataclass
class Result:
    throughput: float
    p50_us: float
    p99_us: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_mlp(folder: Path, seed: int) -> None:
    sys.path.insert(0, str(HERE.parent / "src"))
    from octacloud.serving.testing import mlp_onnx

    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(mlp_onnx((256, 1024, 1024, 10), seed=seed))


def io_of(onnx_path: Path) -> tuple[str, list[int], str, list[int]]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    i, o = s.get_inputs()[0], s.get_outputs()[0]

    def dims(shape: list[object]) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in shape[1:]]

    return i.name, dims(i.shape), o.name, dims(o.shape)


def write_repos(model_dir: Path, work: Path, name: str, max_batch: int, delay_us: int) -> tuple[Path, Path]:
    """Two repositories with the same model and batching: octacloud (onnxruntime) and Triton (python)."""
    onnx = model_dir / "1" / "model.onnx"
    in_name, in_dims, out_name, out_dims = io_of(onnx)
    io = (
        f'input [ {{ name: "{in_name}", data_type: TYPE_FP32, dims: {in_dims} }} ]\n'
        f'output [ {{ name: "{out_name}", data_type: TYPE_FP32, dims: {out_dims} }} ]\n'
    )
    batching = BATCHING.format(max_batch=max_batch, delay_us=delay_us)
    ours = work / "octacloud" / name
    (ours / "1").mkdir(parents=True)
    shutil.copy(onnx, ours / "1" / "model.onnx")
    (ours / "config.pbtxt").write_text(f'backend: "onnxruntime"\n{batching}{io}')
    theirs = work / "triton" / name
    (theirs / "1").mkdir(parents=True)
    shutil.copy(onnx, theirs / "1" / "model.onnx")
    (theirs / "config.pbtxt").write_text(f'backend: "python"\n{batching}{io}')
    site = (PEERS / "triton" / "site-packages.txt").read_text().strip()
    body = (HERE / "peers" / "triton_onnx_model.py").read_text()
    (theirs / "1" / "model.py").write_text(f"import sys; sys.path.insert(0, {site!r})\n{body}")
    return ours.parent, theirs.parent


def wait_ready(port: int, model: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
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


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def perf(
    model: str, port: int, protocol: str, concurrency: int, in_name: str, in_dims: list[int], window_ms: int, work: Path
) -> Result:
    out = work / f"pa-{protocol}-{port}-{concurrency}.csv"
    shape = ",".join(str(max(1, d)) for d in in_dims)
    cmd = [
        str(PERF_ANALYZER),
        "-m",
        model,
        "-u",
        f"127.0.0.1:{port}",
        "-i",
        protocol,
        "--shape",
        f"{in_name}:{shape}",
        "--input-data",
        "random",
        "--concurrency-range",
        f"{concurrency}",
        "-p",
        str(window_ms),
        "-s",
        "50",
        "-r",
        "6",
        "-f",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"perf_analyzer failed ({run.returncode}): {run.stdout[-2000:]}{run.stderr[-2000:]}")
    with out.open() as f:
        row = next(csv.DictReader(f))
    return Result(float(row["Inferences/Second"]), float(row["p50 latency"]), float(row["p99 latency"]))


def serve_and_measure(
    kind: str, repo: Path, model: str, args: argparse.Namespace, in_name: str, in_dims: list[int], work: Path
) -> dict[tuple[str, int], Result]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = {**os.environ, "OCTACLOUD_THREADS": str(args.threads), "OCTACLOUD_BENCH_THREADS": str(args.threads)}
    if kind == "octacloud":
        exe = Path(sys.executable).parent / "octacloud"
        cmd = [
            str(exe),
            "serve",
            "--repository",
            str(repo),
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
            "--threads",
            str(args.threads),
            "--log-level",
            "warning",
        ]
    else:
        cmd = [
            str(TRITONSERVER),
            f"--model-repository={repo}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1",
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            "--log-verbose=0",
        ]
    log = (work / f"{kind}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    results: dict[tuple[str, int], Result] = {}
    try:
        wait_ready(http, model, proc)
        for protocol in args.protocols:
            port = http if protocol == "http" else grpc
            for c in args.concurrency:
                results[(protocol, c)] = perf(model, port, protocol, c, in_name, in_dims, args.window_ms, work)
                r = results[(protocol, c)]
                print(
                    f"  {kind:9} {protocol:4} c={c}: {r.throughput:8.0f} infer/s  p50 {r.p50_us / 1000:6.2f} ms"
                    f"  p99 {r.p99_us / 1000:6.2f} ms",
                    flush=True,
                )
    finally:
        stop(proc)
        log.close()
    return results


def onnxruntime_limit(onnx: Path, in_dims: list[int], batch: int, threads: int, seconds: float) -> float:
    """In-process onnxruntime throughput (samples/s) at ``batch``: what no server can beat."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    s = ort.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    x = np.random.default_rng(0).random((batch, *(max(1, d) for d in in_dims)), dtype=np.float32)
    for _ in range(20):
        s.run(None, {name: x})
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        s.run(None, {name: x})
        calls += 1
    return calls * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (config.pbtxt optional, 1/model.onnx); default: MLP")
    p.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads, both servers")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=2000)
    p.add_argument("--window-ms", type=int, default=3500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-triton", action="store_true")
    args = p.parse_args()

    if not PERF_ANALYZER.exists() or (not args.skip_triton and not TRITONSERVER.exists()):
        subprocess.run([str(HERE / "peers" / "setup.sh")], check=True)
    with tempfile.TemporaryDirectory(prefix="octacloud-bench-") as tmp:
        work = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            model_dir = work / "src" / "mlp"
            build_mlp(model_dir, args.seed)
        name = model_dir.name
        in_name, in_dims, _, _ = io_of(model_dir / "1" / "model.onnx")
        ours, theirs = write_repos(model_dir, work, name, args.max_batch, args.delay_us)
        print(
            f"model {name}: input {in_name} {in_dims}; max_batch_size {args.max_batch}, "
            f"max_queue_delay {args.delay_us} us, 1 instance, {args.threads} onnxruntime thread(s); "
            f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        oc = serve_and_measure("octacloud", ours, name, args, in_name, in_dims, work)
        tr = {} if args.skip_triton else serve_and_measure("triton", theirs, name, args, in_name, in_dims, work)
        limits = {
            c: onnxruntime_limit(model_dir / "1" / "model.onnx", in_dims, c, args.threads, 3.0)
            for c in args.concurrency
        }

    print(
        "\nprotocol conc | octacloud infer/s p50 ms p99 ms | triton infer/s p50 ms p99 ms | "
        "thr ratio  p99 ratio | ORT limit (batch=conc) octacloud/limit"
    )
    for protocol in args.protocols:
        for c in args.concurrency:
            o = oc[(protocol, c)]
            t = tr.get((protocol, c))
            tcols = f"{t.throughput:14.0f} {t.p50_us / 1e3:6.2f} {t.p99_us / 1e3:6.2f}" if t else f"{'-':>28}"
            ratio = f"{o.throughput / t.throughput:9.2f}  {o.p99_us / t.p99_us:9.2f}" if t else f"{'-':>20}"
            print(
                f"{protocol:8} {c:4} | {o.throughput:17.0f} {o.p50_us / 1e3:6.2f} {o.p99_us / 1e3:6.2f} | "
                f"{tcols} | {ratio} | {limits[c]:22.0f} {o.throughput / limits[c]:15.2f}"
            )
    print(
        "\nthr ratio = octacloud/triton throughput (>= 1 is the goal); p99 ratio = octacloud/triton p99 "
        "(<= 1 is the goal); ORT limit = in-process onnxruntime samples/s at batch = concurrency."
    )


if __name__ == "__main__":
    main()
