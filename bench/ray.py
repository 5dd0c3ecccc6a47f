"""Gateway → replica across Ray nodes vs the local backend: perf_analyzer through the gateway, in one run.

    scripts/netns-run .venv/bin/python bench/ray.py [--model-dir DIR] [--seconds 3] [--concurrency 1 8]

Runs the same deployment (default: the seeded MLP 256→1024→1024→10, dynamic batching, one replica on half a
CPU "card", one inference thread) twice: on the local backend (the replica is a process of this machine) and
on the Ray backend (a local Ray cluster of two nodes; the replica is a Ray actor on the node the scheduler
chose, serving OIP itself). Triton's perf_analyzer drives the gateway over HTTP and gRPC (binary tensors) at
each concurrency; the table gives throughput, p50 and p99 per backend and the Ray/local ratio. Both run on
this one machine over loopback: the figures compare the backends' serving paths, not a network.
Run it inside the loopback-only namespace: there Ray binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is named ray.py: keep its folder off the import path, or `import ray` would import this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "src"))

from octacloud.app import Cloud, CloudConfig, ray_cloud  # noqa: E402
from octacloud.control.controller import ControllerSettings  # noqa: E402
from octacloud.control.fleet import CPU_CARD_MODEL  # noqa: E402
from octacloud.control.ray.local import LocalRayCluster  # noqa: E402
from octacloud.core import Gpu, Node  # noqa: E402


def _cloud_bench() -> Any:
    """bench/cloud.py, for its MLP builder and where perf_analyzer is."""
    spec = importlib.util.spec_from_file_location("bench_cloud", ROOT / "bench" / "cloud.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Running:
    """A Cloud on its own event loop in a thread (the bench's main thread runs perf_analyzer)."""

    def __init__(self, make: Callable[[], Cloud]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cloud: Cloud = self._run(self._make(make))
        self._run(self.cloud.start())
        key_file = self.cloud.config.state_dir / "admin.key"
        self.key = key_file.read_text().strip() if key_file.exists() else ""

    @staticmethod
    async def _make(make: Callable[[], Cloud]) -> Cloud:
        return make()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=180)

    def deploy(self, body: dict[str, object], replicas: int) -> list[str]:
        import json

        headers = {"content-type": "application/json", **({"authorization": f"Bearer {self.key}"} if self.key else {})}
        url = f"http://127.0.0.1:{self.cloud.http_port}/admin/deployments"
        request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        urllib.request.urlopen(request, timeout=30).read()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ready = [r for r in self.cloud.store.replicas(str(body["name"])) if r.state.value == "ready"]
            if len(ready) == replicas:
                return [f"{r.node}/gpu{r.gpus[0]}" for r in ready]
            time.sleep(0.2)
        why = sorted({r.message for r in self.cloud.store.replicas(str(body["name"])) if r.message})
        raise SystemExit(f"{body['name']}: {replicas} replicas not ready after 180 s: {why}")

    def stop(self) -> None:
        self._run(self.cloud.stop(stop_replicas=True))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()  # else its self-pipe leaks (pytest reports the unclosed loop)


def config(state: Path, repo: Path, policy: str) -> CloudConfig:
    return CloudConfig(
        repository=repo,
        state_dir=state,
        http_port=0,
        grpc_port=0,
        policy=policy,
        controller=ControllerSettings(interval_s=1.0, health_interval_s=0.5),
    )


def measure(
    pa: str, clouds: dict[str, Running], model: str, args: argparse.Namespace
) -> dict[str, dict[tuple[str, int], dict[str, float]]]:
    """Every (protocol, concurrency) cell on every backend, one after the other and in alternating order, so
    that the machine's background load weighs on both backends alike."""
    out: dict[str, dict[tuple[str, int], dict[str, float]]] = {name: {} for name in clouds}
    names = list(clouds)
    cells = [(protocol, c) for protocol in ("http", "grpc") for c in args.concurrency]
    for k, (protocol, c) in enumerate(cells):
        for name in names if k % 2 == 0 else reversed(names):
            running = clouds[name]
            extra = ["-H", f"authorization: Bearer {running.key}"] if running.key else []  # gRPC: lowercase key
            extra += ["-s", str(args.stability), "-r", str(args.windows)]
            port = running.cloud.http_port if protocol == "http" else running.cloud.grpc_port
            target = f"127.0.0.1:{port}"
            out[name][(protocol, c)] = run_pa(pa, model, target, protocol, c, args.seconds, args.shape, extra)
    return out


def run_pa(
    pa: str, model: str, target: str, protocol: str, concurrency: int, seconds: float, shape: str, extra: list[str]
) -> dict[str, float]:
    """One perf_analyzer run (as bench/cloud.py, plus extra arguments such as the API key header)."""
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as f:
        out = f.name
    argv = [
        pa, "-m", model, "-u", target, "-i", protocol, "--shape", shape, "--input-data", "random",
        "--concurrency-range", str(concurrency), "-p", str(int(seconds * 1000)), "-f", out, *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"perf_analyzer failed ({done.returncode}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
    with open(out) as fh:
        row = next(csv.DictReader(fh))
    os.unlink(out)
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="A Triton-layout model folder (default: MLP).")
    parser.add_argument("--shape", default="INPUT0:256")
    parser.add_argument("--seconds", type=float, default=3.0, help="perf_analyzer measurement window.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--stability", type=int, default=100, help="perf_analyzer -s (%%): this machine is noisy.")
    parser.add_argument("--windows", type=int, default=10, help="perf_analyzer -r: most windows to stabilise.")
    args = parser.parse_args()
    bench = _cloud_bench()
    pa = bench.perf_analyzer_path()
    work = Path(tempfile.mkdtemp(prefix="octacloud-bench-ray-"))
    repo = work / "models"
    if args.model_dir is None:
        bench.build_mlp(repo)
        model = "mlp"
    else:
        model = args.model_dir.name
        (repo / model).parent.mkdir(parents=True)
        os.symlink(args.model_dir.resolve(), repo / model)
    # One replica: perf_analyzer reads the model's statistics through the gateway, which asks whichever replica
    # it routes to; with several replicas the counts it compares come from different servers.
    body = {"name": model, "model": model, "octants": 4, "min_replicas": 1, "max_replicas": 1}
    card = CPU_CARD_MODEL
    placements: dict[str, list[str]] = {}
    local_fleet = [Node("local", 2000, 16384, (Gpu(0, card, 4096), Gpu(1, card, 4096)))]
    ray_fleet = [Node(f"ray-{n}", 1000, 8192, (Gpu(0, card, 4096),)) for n in "ab"]
    # both clouds up at once (same machine, same load), measured cell by cell
    with LocalRayCluster(ray_fleet, temp_dir=Path(f"/tmp/octacloud-bench-ray-{os.getpid()}")):
        clouds: dict[str, Running] = {}
        try:
            clouds["local"] = Running(lambda: Cloud(config(work / "local", repo, "octacloud"), nodes=local_fleet))
            clouds["ray"] = Running(lambda: ray_cloud(config(work / "ray", repo, "spread")))
            for name, running in clouds.items():
                placements[name] = running.deploy(body, 1)
            results = measure(pa, clouds, model, args)
        finally:
            for running in clouds.values():
                running.stop()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(f"/tmp/octacloud-bench-ray-{os.getpid()}", ignore_errors=True)

    print(f"model {model}, 1 replica × 4 octants; local: {placements['local']}; ray: {placements['ray']}")
    print(f"{'protocol':8} {'conc':>4}  {'local inf/s':>11} {'p50 ms':>7} {'p99 ms':>7}   "
          f"{'ray inf/s':>9} {'p50 ms':>7} {'p99 ms':>7}   {'ray/local':>9}")  # fmt: skip
    for (protocol, c), lo in results["local"].items():
        r = results["ray"][(protocol, c)]
        ratio = r["throughput"] / lo["throughput"]
        print(
            f"{protocol:8} {c:>4}  {lo['throughput']:>11.0f} {lo['p50_ms']:>7.2f} {lo['p99_ms']:>7.2f}   "
            f"{r['throughput']:>9.0f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}   {ratio:>9.2f}"
        )


if __name__ == "__main__":
    main()
