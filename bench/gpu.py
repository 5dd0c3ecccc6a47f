"""The design's GPU claims, measured side by side in one run on any NVIDIA machine.

    .venv/bin/python bench/gpu.py --models models --out results/      # or: make gpu-check OUT=results/

Needs an NVIDIA GPU (NVML), onnxruntime with the CUDA execution provider (octacloud's GPU install set) and the
example repository (``make models``: ResNet-50 and BERT-base). Without them it refuses and says what is missing.
Every replica is a real ``octacloud serve`` process confined to its slice exactly as the cloud confines it
(``slice_environment``: ``CUDA_VISIBLE_DEVICES``, MPS active-thread percentage and pinned-memory limit, the memory
budget), behind one MPS control daemon started for the run (:mod:`octacloud.control.mps`; time-slicing when MPS
is unavailable, which the report says). Load comes from separate client processes (tritonclient gRPC, binary
tensors, closed loop), so the client's interpreter is never the bottleneck.

What it prints (and writes as ``gpu.json`` under ``--out``):

1. **8-way sharing** — ResNet-50, batch-1 requests: p50/p99 of one replica alone on the card (8 octants, one
   client) vs 8 replicas of 1 octant each on the same card, one client each, all at once. The design claims
   ≤ 5 % more latency.
2. **Dynamic batching** — BERT-base (sequence 128) throughput at 32 concurrent requests with the repository's
   dynamic batching vs the same model with batching off. The design claims 3.2×.
3. **The limit** — ResNet-50 served at 32 concurrent requests vs the same model in onnxruntime in-process
   (CUDA provider, batch 32 in a loop): served ÷ in-process samples per second.
4. **An octant budget** — ResNet-50 throughput of a 1-octant replica vs an 8-octant replica (each alone on the
   card, 8 concurrent requests): does one octant give about 1/8 of the card?
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from octacloud.control.fleet import nvml_host_node
from octacloud.control.mps import MpsDaemon, NvmlComputeModes
from octacloud.control.slices import Slice, slice_environment
from octacloud.observability.dcgm import open_nvml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Served:
    proc: subprocess.Popen[bytes]
    grpc: int
    http: int
    log: Path


@contextmanager
def serve(repo: Path, env: dict[str, str], logs: Path, name: str, timeout: float = 300) -> Iterator[Served]:
    """``octacloud serve`` on ``repo`` with the slice's environment, until it answers ready; stopped by PID."""
    http, grpc = _free_port(), _free_port()
    log = logs / f"{name}.log"
    exe = Path(sys.executable).parent / "octacloud"
    argv = [str(exe) if exe.exists() else "octacloud", "serve", "--repository", str(repo), "--http-port", str(http),
            "--grpc-port", str(grpc), "--metrics-port", "-1", "--log-level", "warning"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"replica {name} exited ({proc.returncode}); see {log}:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {name} not ready within {timeout:.0f} s; see {log}")
            time.sleep(0.2)
        yield Served(proc, grpc, http, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- load: closed-loop clients in their own processes ------------------------------------------------------


def _inputs(model: str, rows: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    if model.startswith("resnet50"):
        return [("pixel_values", rng.standard_normal((rows, 3, 224, 224), dtype=np.float32))]
    ids = rng.integers(1000, 20000, size=(rows, 128), dtype=np.int64)
    return [("input_ids", ids), ("attention_mask", np.ones_like(ids)), ("token_type_ids", np.zeros_like(ids))]


async def _drive(port: int, model: str, concurrency: int, seconds: float, warmup: float) -> tuple[list[float], float]:
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    arrays = _inputs(model, 1)
    inputs = []
    for name, array in arrays:
        item = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array)
        inputs.append(item)
    latencies: list[float] = []
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def worker() -> None:
        while (now := time.perf_counter()) < end:
            await client.infer(model, inputs)
            done = time.perf_counter()
            if now >= measure_from:
                latencies.append((done - now) * 1000)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return latencies, seconds


def _client(port: int, model: str, concurrency: int, seconds: float, warmup: float, out: Any) -> None:
    out.send(asyncio.run(_drive(port, model, concurrency, seconds, warmup)))


@dataclass(slots=True)
class Load:
    requests: int
    per_s: float
    p50_ms: float
    p99_ms: float


def load(targets: Sequence[tuple[int, str, int]], seconds: float, warmup: float) -> Load:
    """Drive every (port, model, concurrency) at once, one client process each; pooled latencies."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for port, model, concurrency in targets:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client, args=(port, model, concurrency, seconds, warmup, send))
        p.start()
        pipes.append(recv)
        procs.append(p)
    latencies: list[float] = []
    for recv in pipes:
        got, _ = recv.recv()
        latencies.extend(got)
    for p in procs:
        p.join()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else latencies * 99
    return Load(len(latencies), len(latencies) / seconds, q[49], q[98])


# ---- the four checks ------------------------------------------------------------------------------------------


def one_model_repo(models: Path, model: str, into: Path, batching: bool = True) -> Path:
    """A repository holding ``model`` alone (linked), optionally with dynamic batching removed."""
    repo = into / (model + ("" if batching else "_nobatch"))
    folder = repo / model
    folder.mkdir(parents=True)
    for version in (models / model).iterdir():
        if version.is_dir():
            (folder / version.name).symlink_to(version.resolve())
    config = (models / model / "config.pbtxt").read_text()
    if not batching:
        lines, skip = [], 0
        for line in config.splitlines():
            if line.startswith("dynamic_batching"):
                skip = 1 if "}" not in line else 0
                continue
            if skip:
                skip = 0 if line.startswith("}") else 1
                continue
            lines.append(line)
        config = "\n".join(lines) + "\n"
    (folder / "config.pbtxt").write_text(config)
    return repo


def in_process(models: Path, model: str, batch: int, seconds: float) -> float:
    """Samples per second of onnxruntime (CUDA) running ``batch``-row batches in a loop: the limit."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        str(models / model / "1" / "model.onnx"), providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    feed = dict(_inputs(model, batch))
    for _ in range(5):
        session.run(None, feed)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, feed)
        n += 1
    return n * batch / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    node = nvml_host_node()
    assert node is not None
    scratch = Path(tempfile.mkdtemp(prefix="octacloud-gpu-"))
    logs = scratch / "logs"
    logs.mkdir()
    nvml = open_nvml()
    mps = MpsDaemon(scratch / "state", cards=tuple(range(node.gpu_count)),
                    compute_modes=NvmlComputeModes(nvml) if nvml is not None else None)  # fmt: skip
    mode = mps.start()
    print(f"GPU sharing: {mode.value} ({mps.reason})", flush=True)
    results: dict[str, Any] = {"sharing": mode.value, "sharing_reason": mps.reason}
    s, w = args.seconds, args.warmup

    def env(octants: int) -> dict[str, str]:
        return {**slice_environment(node, Slice(node.name, (0,), octants * 125)), **mps.environment()}

    try:
        resnet = one_model_repo(args.models, "resnet50", scratch)
        with serve(resnet, env(8), logs, "resnet-alone") as r:
            alone = load([(r.grpc, "resnet50", 1)], s, w)
        with ExitStack() as stack:
            replicas = [stack.enter_context(serve(resnet, env(1), logs, f"resnet-share{i}")) for i in range(8)]
            shared = load([(x.grpc, "resnet50", 1) for x in replicas], s, w)
        results["sharing_8way"] = {
            "alone": asdict(alone),
            "shared": asdict(shared),
            "p50_ratio": shared.p50_ms / alone.p50_ms,
            "p99_ratio": shared.p99_ms / alone.p99_ms,
        }
        print_row("8-way sharing, ResNet-50 b=1", f"alone p50 {alone.p50_ms:.2f} p99 {alone.p99_ms:.2f} ms",
                  f"8 sharing p50 {shared.p50_ms:.2f} p99 {shared.p99_ms:.2f} ms",
                  f"p50 ×{shared.p50_ms / alone.p50_ms:.3f} (claim ≤ 1.05)")  # fmt: skip

        bert_on, bert_off = (one_model_repo(args.models, "bert_base", scratch, b) for b in (True, False))
        with serve(bert_on, env(8), logs, "bert-batching") as r:
            batched = load([(r.grpc, "bert_base", 32)], s, w)
        with serve(bert_off, env(8), logs, "bert-nobatch") as r:
            single = load([(r.grpc, "bert_base", 32)], s, w)
        results["bert_batching"] = {"batching": asdict(batched), "no_batching": asdict(single),
                                    "ratio": batched.per_s / single.per_s}  # fmt: skip
        print_row("BERT-base c=32, dynamic batching", f"on {batched.per_s:.1f}/s", f"off {single.per_s:.1f}/s",
                  f"×{batched.per_s / single.per_s:.2f} (claim 3.2)")  # fmt: skip

        with serve(resnet, env(8), logs, "resnet-limit") as r:
            served = load([(r.grpc, "resnet50", 32)], s, w)
        limit = in_process(args.models, "resnet50", 32, s)
        results["limit"] = {"served": asdict(served), "in_process_samples_per_s": limit, "ratio": served.per_s / limit}
        print_row("ResNet-50 c=32 vs in-process", f"served {served.per_s:.1f}/s", f"in-process {limit:.1f}/s",
                  f"×{served.per_s / limit:.3f} of the limit")  # fmt: skip

        with serve(resnet, env(1), logs, "resnet-1oct") as r:
            one = load([(r.grpc, "resnet50", 8)], s, w)
        with serve(resnet, env(8), logs, "resnet-8oct") as r:
            eight = load([(r.grpc, "resnet50", 8)], s, w)
        results["octant_budget"] = {"one_octant": asdict(one), "eight_octants": asdict(eight),
                                    "ratio": one.per_s / eight.per_s}  # fmt: skip
        print_row("ResNet-50 c=8, 1 vs 8 octants", f"1 octant {one.per_s:.1f}/s", f"8 octants {eight.per_s:.1f}/s",
                  f"×{one.per_s / eight.per_s:.3f} (1/8 = 0.125)")  # fmt: skip
    finally:
        mps.stop()
        if args.out is not None:
            shutil.copytree(logs, args.out / "replica-logs", dirs_exist_ok=True)
    return results


def print_row(what: str, a: str, b: str, ratio: str) -> None:
    print(f"{what:<36} {a:<34} {b:<34} {ratio}", flush=True)


def machine() -> dict[str, Any]:
    import onnxruntime as ort
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    return {
        "gpu": text(pynvml.nvmlDeviceGetName(h)),
        "gpus": pynvml.nvmlDeviceGetCount(),
        "driver": text(pynvml.nvmlSystemGetDriverVersion()),
        "cuda_driver": pynvml.nvmlSystemGetCudaDriverVersion(),
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def refuse_without_gpu() -> str | None:
    """Why this machine cannot run the check, or None."""
    if open_nvml() is None:
        return "no NVIDIA GPU: NVML found none (bench/gpu.py measures GPU claims and runs only on an NVIDIA machine)"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        available = ", ".join(ort.get_available_providers())
        return (
            f"onnxruntime {ort.__version__} here has no CUDAExecutionProvider (available: {available}): "
            "install octacloud's GPU set (make install on a GPU host)"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models"), help="the example repository (make models)")
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu.json and the replicas' logs")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each point")
    args = parser.parse_args(argv)
    why = refuse_without_gpu()
    if why is not None:
        print(f"bench/gpu.py: {why}", file=sys.stderr)
        return 2
    missing = [m for m in ("resnet50", "bert_base") if not (args.models / m / "1" / "model.onnx").is_file()]
    if missing:
        print(f"bench/gpu.py: {', '.join(missing)} not in {args.models}: build the example repository (make models)",
              file=sys.stderr)  # fmt: skip
        return 2
    info = machine()
    print(json.dumps(info), flush=True)
    results = {"machine": info, **run(args)}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
