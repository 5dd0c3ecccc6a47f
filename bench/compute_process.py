"""What computing a model in a child process (config parameter ``compute: "process"``) costs on this machine,
side by side with computing it in the replica's process, for one model and batch size.

    .venv/bin/python bench/compute_process.py [--model DIR] [--rows 1 4] [--calls 3000] [--rounds 2]

Loads the model twice, with onnxruntime in this process and in a :class:`~octacloud.serving.compute.
ComputeProcess` child, and runs the same batches through each, alternating, one call at a time: per call the
wall time, this process's CPU and the child's CPU (``/proc/PID/stat``). The difference is the hand-off: a
pickle each way and two wake-ups, one on each side. A last line runs a bare ping-pong over a socketpair (no
model, no pickle) between two processes, which is what the wake-ups alone cost here; with ``--same-core`` both
processes are pinned to one core as well, which shows what a wake-up across cores adds.

Default model: the MLP 256→1024→1024→10 (seeded; needs the ``onnx`` package).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from benchutil import TICK_S  # noqa: E402
from octacloud.serving.compute import ComputeProcess  # noqa: E402
from octacloud.serving.repository.config import read_config  # noqa: E402
from octacloud.serving.runtime import OnnxRuntimeFactory  # noqa: E402
from octacloud.serving.types import numpy_dtype  # noqa: E402
from record import Recorder, add_flag  # noqa: E402


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def mlp_model(work: Path) -> Path:
    from octacloud.serving.testing import mlp_onnx, write_onnx_model

    config = (
        'backend: "onnxruntime"\nmax_batch_size: 32\n'
        'input [ { name: "input", data_type: TYPE_FP32, dims: [256] } ]\n'
        'output [ { name: "output", data_type: TYPE_FP32, dims: [10] } ]\n'
    )
    return write_onnx_model(work, "mlp", mlp_onnx(), config)


def ping_pong(calls: int, same_core: bool) -> tuple[float, float, float]:
    """(wall, parent CPU, child CPU) in µs per round trip of one byte between two processes."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child echoes until the socket closes
        a.close()
        if same_core:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        while data := b.recv(64):
            b.send(data)
        os._exit(0)
    b.close()
    saved = os.sched_getaffinity(0)
    if same_core:
        os.sched_setaffinity(0, {min(saved)})
    try:
        for _ in range(200):
            a.send(b"x")
            a.recv(64)
        t0, c0, k0 = time.perf_counter(), time.process_time(), cpu_s(pid)
        for _ in range(calls):
            a.send(b"x")
            a.recv(64)
        t1, c1, k1 = time.perf_counter(), time.process_time(), cpu_s(pid)
    finally:
        a.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, saved)
    return (t1 - t0) / calls * 1e6, (c1 - c0) / calls * 1e6, (k1 - k0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (config.pbtxt, 1/model.onnx); default: the MLP")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="batch sizes")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    add_flag(p)
    args = p.parse_args()
    recorder = Recorder("compute_process")
    figures: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="octacloud-compute-") as tmp:
        folder = args.model or mlp_model(Path(tmp))
        config = read_config(folder)
        factory = OnnxRuntimeFactory()
        here = factory(folder / "1", config, args.threads)
        child = ComputeProcess(factory, folder / "1", config, args.threads)
        try:
            names = tuple(t.name for t in here.outputs)
            print(
                f"model {folder.name}, {args.threads} onnxruntime thread(s), {args.calls} calls per point; "
                f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
            )
            print(f"{'rows':>4} {'where':8} {'wall us':>8} {'this cpu':>8} {'child cpu':>9} {'cpu/call':>8}")
            for rows in args.rows:
                feed = {
                    t.name: np.random.default_rng(0)
                    .random((rows, *(max(1, d) for d in t.shape[1:])))
                    .astype(numpy_dtype(t.datatype))
                    for t in here.inputs
                }
                results: dict[str, list[tuple[float, float, float]]] = {"replica": [], "process": []}
                for r in range(args.rounds):
                    order = ("replica", "process") if r % 2 == 0 else ("process", "replica")
                    for where in order:
                        run = here.run if where == "replica" else child.run
                        for _ in range(100):
                            run(feed, names)
                        t0, c0, k0 = time.perf_counter(), time.process_time(), cpu_s(child.pid)
                        for _ in range(args.calls):
                            run(feed, names)
                        t1, c1, k1 = time.perf_counter(), time.process_time(), cpu_s(child.pid)
                        n = args.calls
                        results[where].append(((t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6, (k1 - k0) / n * 1e6))
                for where, runs in results.items():
                    wall, mine, theirs = (statistics.median(x[i] for x in runs) for i in range(3))
                    print(f"{rows:4} {where:8} {wall:8.0f} {mine:8.0f} {theirs:9.0f} {mine + theirs:8.0f}")
                    figures.append({"rows": rows, "where": where, "wall_us": wall, "cpu_us": mine,
                                    "child_cpu_us": theirs})  # fmt: skip
        finally:
            child.close()
            here.close()
        for same in (False, True):
            wall, mine, theirs = ping_pong(args.calls, same)
            where = "one core" if same else "any core"
            print(f"ping-pong, {where}: {wall:6.0f} us wall, {mine:4.0f} + {theirs:4.0f} us CPU per round trip")
            figures.append({"ping_pong": where, "wall_us": wall, "cpu_us": mine, "child_cpu_us": theirs})
    print(
        "\nreplica: onnxruntime in this process; process: in a compute child (the hand-off: a pickle each way and "
        "two wake-ups). cpu/call = this process's CPU + the child's, per call."
    )
    recorder.save(figures)


if __name__ == "__main__":
    main()
