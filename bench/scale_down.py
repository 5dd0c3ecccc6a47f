"""Gateway p99 of one deployment while another scales down, against its p99 without, in one run.

    .venv/bin/python bench/scale_down.py [--rounds 3] [--window 3] [--clients 4] [--replicas 3]

Starts a cloud in this process (gateway and controller on one event loop, as ``octacloud up`` runs them) on a
declared one-node fleet of CPU cards, with two deployments of a small ONNX model: ``steady`` (one replica) and
``other``. Closed-loop clients send requests to ``steady`` through the gateway the whole time. Each round:
``other`` is scaled up to ``--replicas`` (not measured), then ``steady``'s latencies are recorded for
``--window`` seconds with nothing else happening ("without"), then ``other`` is scaled down to one replica and
``steady``'s latencies are recorded for the same time from that moment ("during": the controller drains and
stops the surplus replicas: SIGTERM, their exit, slices released), then once more when all is quiet again with
one replica of ``other`` ("without (1 replica)": fewer processes compete for the CPU, so the two "without"
windows bracket the CPU contention). Prints the p99s, their ratios, request counts and failures, and the load
average. Goal: during within 10 % of without.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from octacloud.app import Cloud, CloudConfig
from octacloud.control.controller import ControllerSettings
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from record import Recorder, add_flag

IN, OUT = 64, 8


def build_model(repo: Path, name: str = "small") -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.standard_normal((IN, OUT)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", IN])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", OUT])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {IN} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {OUT} ] }} ]\n'
    )


class CloudThread:
    def __init__(self, config: CloudConfig, nodes: list[Node], work: Path | None = None) -> None:
        self.work = work
        """A temporary folder of the bench's that ``close`` removes (its repository and state)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cloud: Cloud = self.run(self._make(config, nodes))
        self.run(self.cloud.start())
        self.url = f"http://127.0.0.1:{self.cloud.http_port}"
        self.auth = {"Authorization": f"Bearer {(config.state_dir / 'admin.key').read_text().strip()}"}

    @staticmethod
    async def _make(config: CloudConfig, nodes: list[Node]) -> Cloud:
        return Cloud(config, nodes=nodes)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = httpx.request(method, f"{self.url}/admin{path}", json=body, headers=self.auth, timeout=30)
        if r.status_code >= 400:
            raise SystemExit(f"{method} {path}: {r.status_code} {r.text}")
        return r.json()

    def ready(self, name: str) -> int:
        return sum(1 for r in self.admin("GET", f"/deployments/{name}")["instances"] if r["state"] == "ready")

    def count(self, name: str) -> int:
        return len(self.admin("GET", f"/deployments/{name}")["instances"])

    def wait(self, what: str, predicate: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise SystemExit(f"timed out waiting for {what}")

    def close(self) -> None:
        self.run(self.cloud.stop(stop_replicas=True))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)

    @classmethod
    def in_temp(cls, prefix: str, nodes: list[Node], settings: ControllerSettings) -> CloudThread:
        """A cloud on ``nodes`` serving the bench's small model, its repository and state in a new temporary
        folder (removed by ``close``)."""
        tmp = Path(tempfile.mkdtemp(prefix=prefix))
        build_model(tmp / "models")
        config = CloudConfig(
            repository=tmp / "models", state_dir=tmp / "var", http_port=0, grpc_port=0, controller=settings
        )
        return cls(config, nodes, tmp)


class LoopLag:
    """How late the cloud's event loop runs a 10 ms timer: what a stall of the gateway's loop looks like."""

    def __init__(self, cloud: CloudThread) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = False
        asyncio.run_coroutine_threadsafe(self._tick(), cloud.loop)

    async def _tick(self) -> None:
        while not self._stop:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            self.samples.append((t0, time.monotonic() - t0 - 0.01))

    def worst_ms(self, start: float, end: float) -> float:
        return max((lag for t, lag in self.samples if start <= t < end), default=0.0) * 1000

    def close(self) -> None:
        self._stop = True


class Load:
    """Closed-loop clients on one deployment; records (start, latency s, ok)."""

    def __init__(self, url: str, auth: dict[str, str], name: str, clients: int) -> None:
        self.url, self.auth, self.name = url, auth, name
        self.results: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        x = np.random.default_rng(0).standard_normal((1, IN)).astype(np.float32)
        body = {"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32", "data": x.ravel().tolist()}]}
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = client.post(f"/v2/models/{self.name}/infer", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.results.append((t0, time.monotonic() - t0, ok))

    def window(self, start: float, end: float) -> list[tuple[float, float, bool]]:
        return [r for r in self.results if start <= r[0] < end]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=35)


def p99_ms(rows: list[tuple[float, float, bool]]) -> float:
    lat = sorted(r[1] for r in rows)
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured per phase and round")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=3, help="replicas of 'other' before each scale-down")
    add_flag(ap)
    args = ap.parse_args()
    recorder = Recorder("scale_down")
    figures: dict[str, Any] = {}
    nodes = [Node("bench", 16_000, 65_536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2)))]
    settings = ControllerSettings(interval_s=1.0, health_interval_s=0.2, stop_grace_s=5.0)
    c = CloudThread.in_temp("octacloud-scale-down-", nodes, settings)
    load: Load | None = None
    lag: LoopLag | None = None
    try:
        c.admin("POST", "/deployments", {"name": "steady", "model": "small", "octants": 2})
        c.admin("POST", "/deployments", {"name": "other", "model": "small", "octants": 2, "max_replicas": 4})
        c.wait("steady ready", lambda: c.ready("steady") == 1)
        load = Load(c.url, c.auth, "steady", args.clients)
        lag = LoopLag(c)
        windows: dict[str, list[tuple[float, float]]] = {"without (N replicas)": [], "during scale-down": [],
                                                          "without (1 replica)": []}  # fmt: skip
        time.sleep(1.0)  # warm up
        without: list[tuple[float, float, bool]] = []
        during: list[tuple[float, float, bool]] = []
        after: list[tuple[float, float, bool]] = []
        for k in range(args.rounds):
            c.admin("POST", "/deployments/other/scale", {"replicas": args.replicas})
            c.wait("other scaled up", lambda: c.ready("other") == args.replicas)
            time.sleep(2.0)  # let the new replicas settle: their start-up is not what is measured
            t0 = time.monotonic()
            time.sleep(args.window)
            without += load.window(t0, t0 + args.window)
            windows["without (N replicas)"].append((t0, t0 + args.window))
            t1 = time.monotonic()
            c.admin("POST", "/deployments/other/scale", {"replicas": 1})
            time.sleep(args.window)
            during += load.window(t1, t1 + args.window)
            windows["during scale-down"].append((t1, t1 + args.window))
            c.wait("other scaled down", lambda: c.count("other") == 1)
            time.sleep(1.0)
            t2 = time.monotonic()
            time.sleep(args.window)
            after += load.window(t2, t2 + args.window)
            windows["without (1 replica)"].append((t2, t2 + args.window))
            print(f"round {k + 1}: without p99 {p99_ms(load.window(t0, t0 + args.window)):.1f} ms, "
                  f"during p99 {p99_ms(load.window(t1, t1 + args.window)):.1f} ms, "
                  f"after p99 {p99_ms(load.window(t2, t2 + args.window)):.1f} ms", flush=True)  # fmt: skip
        stops = [e for e in c.admin("GET", "/events?limit=500")["events"] if e["kind"] == "stopped"]
        a, b = p99_ms(without), p99_ms(during)
        print(
            f"\nsteady's gateway latency, {args.clients} closed-loop clients, {args.rounds} rounds × {args.window:g} s:"
        )
        for what, rows in (
            ("without (N replicas)", without),
            ("during scale-down", during),
            ("without (1 replica)", after),
        ):
            fails = sum(1 for r in rows if not r[2])
            p50 = statistics.median(r[1] for r in rows) * 1000 if rows else float("nan")
            worst = max((lag.worst_ms(a, b) for a, b in windows[what]), default=0.0) if lag else float("nan")
            print(
                f"  {what:>20}: {len(rows):6d} requests, {fails} failed, p50 {p50:6.2f} ms, p99 {p99_ms(rows):6.2f} ms,"
                f" worst event-loop lag {worst:6.1f} ms"
            )
            figures[what] = {"requests": len(rows), "failed": fails, "p50_ms": p50, "p99_ms": p99_ms(rows),
                             "worst_loop_lag_ms": worst}  # fmt: skip
        print(f"  ratio during/without p99: {b / a:.3f} (against N replicas), {b / p99_ms(after):.3f} (against 1)")
        print(f"  {len(stops)} replicas stopped during the run")
        print(f"  load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        recorder.save({"windows": figures, "stopped": len(stops)})
    finally:
        if load is not None:
            load.close()
        if lag is not None:
            lag.close()
        c.close()


if __name__ == "__main__":
    sys.exit(main())
